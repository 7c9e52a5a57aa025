"""Scheduler configuration (caller settings, never mutated at run time)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlt_contracts import ConfigurationError

AUTO_TICKS = "auto"  # prefill_step_decode_ticks: the model depth


class SchedulingMode(enum.StrEnum):
    """How new tokens join the recurrent batch.

    REFILL     a token that exits is sampled at once and its successor starts loop 1 in the next
               tick, next to other rows at any depth (default).
    NO_REFILL  the rows decoding together form a cohort: a row whose token exited (and was
               sampled) waits until no row is looping, then all waiting rows start together.
    """

    REFILL = "refill"
    NO_REFILL = "no_refill"


class SchedulingPolicy(enum.StrEnum):
    """Admission order: FCFS (arrival) or PRIORITY (lower `priority` first, ties by arrival)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching, admission and memory policy.

    max_num_seqs: requests holding KV and runner state at once (decode rows per step <= this).
    max_num_batched_tokens: token rows per step through the recurrent stack: one per decoding
      request plus every prefill-chunk token.
    max_num_batched_token_loops: optional cap on token x loop passes per step: a decode row
      costs 1, a prefill token costs the model depth T (it runs every loop). None: no cap.
    prefill_chunk_size: at most this many prompt tokens of one request per step.
    policy / mode: see SchedulingPolicy / SchedulingMode.
    incremental_kv: claim KV pages as a request's frontier grows instead of reserving its whole
      lifetime (prompt + max_tokens - 1) at admission.
    watermark_ratio: fraction of the pool kept free at admission while other requests run.
    enable_preemption: under memory pressure, or for a higher-priority arrival, suspend a running
      request to a CPU snapshot and resume it later, losslessly.
    admission_scan_limit / max_admission_bypasses: bounded bypass: admission looks at most this
      far down the queue past a request that does not fit, and stops letting later requests
      pass once one waiting request has been passed max_admission_bypasses times.
    decode_ticks_per_step: most loop ticks one step runs for its decoding rows without a host
      round trip (the device applies exits, sampling and stops itself); steps that carry prompt
      work run `prefill_step_decode_ticks`.
    prefill_step_decode_ticks: ticks of a step that can compute prompts (one is in PREFILL or a
      waiting request can start): 1 (default) keeps the time to first token lowest; "auto"
      runs the model depth, so every decoding row makes about one token per prompt step (as a
      chunked-prefill step of a non-looped model does); never more than
      `decode_ticks_per_step` (tick_policy.py).
    scheduler_delay_factor: F > 0: while requests run, a waiting request is admitted only
      once it waited F x the duration of the latest step that computed prompts, so prompts
      that arrive within that window start together (vLLM's scheduler_delay_factor;
      admission_delay.py); 0 (default) admits at once.
    max_waiting_requests: bound on the requests that really wait (left waiting by a step, or
      queued since beyond the free runner slots); add_request beyond it raises OverloadedError.
    num_speculative_tokens: K > 0: decoding runs self-speculative rounds of K drafts
      (decode_work.py); 0: ticks only.
    speculative_disable_batch_size: with K > 0, steps in which more requests than this decode
      run ticks instead of rounds (None: never).
    whole_prompts: a prompt is computed in one step, never in chunks (a prefix-LM family's
      prompt is one bidirectional block); it waits for a step with room for all of it, so the
      token budget must hold the longest prompt (the engine sets it to the context length).
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_num_batched_token_loops: int | None = None
    prefill_chunk_size: int = 128
    mode: SchedulingMode = SchedulingMode.REFILL
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    incremental_kv: bool = False
    watermark_ratio: float = 0.0
    enable_preemption: bool = False
    admission_scan_limit: int = 64
    max_admission_bypasses: int = 8
    max_waiting_requests: int = 4096
    decode_ticks_per_step: int = 8
    prefill_step_decode_ticks: int | str = 1
    scheduler_delay_factor: float = 0.0
    num_speculative_tokens: int = 0
    speculative_disable_batch_size: int | None = None
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "max_waiting_requests",
            "admission_scan_limit",
            "max_admission_bypasses",
            "decode_ticks_per_step",
        ):
            _positive_int(name, getattr(self, name))
        ticks = self.prefill_step_decode_ticks
        if ticks != AUTO_TICKS:
            _positive_int("prefill_step_decode_ticks", ticks, also="'auto'")
        delay = self.scheduler_delay_factor
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0:
            raise ConfigurationError(
                "scheduler_delay_factor", f"must be a number >= 0, got {delay!r}"
            )
        if self.max_num_batched_token_loops is not None:
            _positive_int("max_num_batched_token_loops", self.max_num_batched_token_loops)
        if self.speculative_disable_batch_size is not None:
            _positive_int("speculative_disable_batch_size", self.speculative_disable_batch_size)
        tokens = self.num_speculative_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigurationError(
                "num_speculative_tokens", f"must be a non-negative integer, got {tokens!r}"
            )
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ConfigurationError(
                ("max_num_batched_tokens", "max_num_seqs"),
                f"the token budget ({self.max_num_batched_tokens}) must exceed the number of "
                f"decode rows ({self.max_num_seqs}) so prefill always progresses",
            )
        if not 0.0 <= self.watermark_ratio < 1.0:
            raise ConfigurationError(
                "kv_watermark", f"must be in [0, 1), got {self.watermark_ratio}"
            )
        for name, enum_type, option in (
            ("mode", SchedulingMode, "scheduling_mode"),
            ("policy", SchedulingPolicy, "scheduling_policy"),
        ):
            try:
                object.__setattr__(self, name, enum_type(getattr(self, name)))
            except ValueError:
                raise ConfigurationError(
                    option,
                    f"must be one of {[m.value for m in enum_type]}, got {getattr(self, name)!r}",
                ) from None

    def prefill_step_ticks(self, model_depth: int) -> int:
        """Ticks of a step that can compute prompts (`prefill_step_decode_ticks` resolved)."""
        ticks = self.prefill_step_decode_ticks
        wanted = model_depth if ticks == AUTO_TICKS else ticks
        return min(wanted, self.decode_ticks_per_step)

    def check_depth(self, model_depth: int) -> None:
        """The token x loop cap must admit at least one prefill token next to full decode rows."""
        cap = self.max_num_batched_token_loops
        if cap is not None and cap < self.max_num_seqs + model_depth:
            raise ConfigurationError(
                ("max_num_batched_token_loops", "max_num_seqs"),
                f"{cap} token-loops cannot hold {self.max_num_seqs} decode rows plus one prefill "
                f"token at depth {model_depth}",
            )


def _positive_int(name: str, value: object, *, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alternative = f" or {also}" if also else ""
        raise ConfigurationError(name, f"must be a positive integer{alternative}, got {value!r}")
