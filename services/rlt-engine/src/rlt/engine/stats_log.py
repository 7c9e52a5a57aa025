"""Live engine statistics: one INFO line every `stats_interval_s` seconds while the engine has
work (vLLM's periodic stats line), written by the engine core's loop (`CoreLoop`), so once per
engine however many front ends it has. docs/serving.md, "Live engine statistics", gives the
line's figures, its windows and where it is logged.

Every number comes from host counters the engine keeps anyway (`EngineCore.stats()`, the
scheduler's `loop_mix()`), read once per line: nothing is added to the step loop but a clock
read and two comparisons, and nothing waits for the device. A window opens when a step runs
while none is open and its line is due `interval_s` later; an engine that went idle before
then is woken by its transport at the due time (`seconds_until_due`). Rates are over the busy
span (from the window's start to now, or to its last step when the engine went idle).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlt_contracts import EngineStats

logger = logging.getLogger("rlt.engine.stats")


@dataclass(frozen=True)
class StatsSample:
    """The counters one line compares: the engine's statistics and its loop mix."""

    stats: EngineStats
    decoded_tokens: int
    early_exit_tokens: int

    @classmethod
    def of(cls, core) -> StatsSample:
        """Read `core` (an `EngineCore`; host counters only)."""
        decoded, early = core.loop_mix()
        return cls(core.stats(), decoded, early)


def _tokens_per_s(tokens: int, seconds: float) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}"


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "n/a"


def stats_line(before: StatsSample, after: StatsSample, busy_s: float) -> str:
    """The line for the window between two samples, `busy_s` seconds of it with work."""
    a, b = before.stats, after.stats
    decoded = after.decoded_tokens - before.decoded_tokens
    if decoded > 0:
        loops = (b.decode_loops - a.decode_loops) / decoded
        early = _percent(after.early_exit_tokens - before.early_exit_tokens, decoded)
        loop_mix = f"loops per token {loops:.1f} ({early} exited early)"
    else:
        loop_mix = "loops per token n/a"
    parts = [
        f"prompt throughput {_tokens_per_s(b.prompt_tokens - a.prompt_tokens, busy_s)} tok/s",
        "generation throughput "
        f"{_tokens_per_s(b.generation_tokens - a.generation_tokens, busy_s)} tok/s",
        f"{b.running_requests} running",
        f"{b.waiting_requests} waiting",
        f"KV {_percent(b.kv_blocks_used, b.kv_blocks_total)}",
        "prefix hits "
        + _percent(
            b.prefix_cache_hit_tokens - a.prefix_cache_hit_tokens,
            b.prefix_cache_queried_tokens - a.prefix_cache_queried_tokens,
        ),
        loop_mix,
    ]
    preempted = b.preemptions - a.preemptions
    if preempted > 0:
        parts.append(f"{preempted} preempted")
    drafts = b.spec_draft_tokens - a.spec_draft_tokens
    if drafts > 0:
        accepted = _percent(b.spec_accepted_tokens - a.spec_accepted_tokens, drafts)
        parts.append(f"drafts accepted {accepted}")
    return "engine: " + ", ".join(parts)


def make_visible() -> None:
    """INFO lines of `rlt.engine.stats` reach a handler whatever the process's log level: the
    logger's own level is INFO unless someone set one, and a process whose logging nobody set
    up gets a handler on the process's real stderr. A Ray Serve replica is such a process:
    Python's last-resort handler would drop INFO, and Serve points `sys.stderr` at its own log
    files, while Ray streams the real stderr to the `rlt ray serve` console."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler added later would print it twice


class StatsLog:
    """The windows and lines of one engine core (see the module docstring). Not thread-safe:
    the core loop's thread calls every method."""

    def __init__(
        self, read: Callable[[], StatsSample], interval_s: float, *, clock=time.monotonic
    ) -> None:
        if not 0 < interval_s < float("inf"):
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._read = read
        self.interval_s = interval_s
        self._clock = clock
        self._baseline = read()  # counters change only in steps: valid across idle time
        self._window_start_s: float | None = None
        self._last_work_s = 0.0

    def step_starting(self) -> None:
        """A step with work is about to run: open a window if none is open."""
        if self._window_start_s is None:
            self._window_start_s = self._clock()

    def step_done(self, now: float, idle: bool) -> None:
        """The step ran (`now`: the clock after it; `idle`: no work remains)."""
        self._last_work_s = now
        if now - self._window_start_s >= self.interval_s:
            self._write(now, idle)

    def idle_tick(self, now: float) -> None:
        """A round without a step: write the line of a window whose time has come."""
        if self._window_start_s is not None and now - self._window_start_s >= self.interval_s:
            self._write(now, idle=True)

    def seconds_until_due(self, now: float) -> float | None:
        """How long an idle transport may block before the next line is due (None: no window
        is open, so until a message comes)."""
        if self._window_start_s is None:
            return None
        return max(0.0, self._window_start_s + self.interval_s - now)

    def _write(self, now: float, idle: bool) -> None:
        sample = self._read()
        busy_s = (self._last_work_s if idle else now) - self._window_start_s
        logger.info("%s", stats_line(self._baseline, sample, busy_s))
        self._baseline = sample
        self._window_start_s = None if idle else now
