"""How every rlt server reads SIGINT and SIGTERM: one drain per shutdown (what each signal
does and the exit codes: docs/serving.md, "Shutdown").

`rlt serve` (and its front-end supervisor for `--api-server-count N`), `rlt pd serve` and Ray's
commands install one `StopSignals` in the main thread before they start anything, and call
`finish()` when they are done (after a stop by signal, later copies are then ignored: a
launcher's copy must not kill the exiting interpreter). Every signal it counts moves the
shutdown one *stage* on (1: stop the start-up or drain; 2: end what still runs at once,
exit `FORCED_EXIT_BASE` + the signal; 3+: stop at once); what a stage does depends on the
phase the command is in, which it states with `acting(action)`.

Duplicates: `uv run` forwards its own copy of a SIGINT the whole process group already
received (about 200 ms later), and a SIGTERM to the group reaches rlt once directly and once
through uv. So a signal within `DUPLICATE_WINDOW_S` (1 s) of the last one counted, SIGINT or
SIGTERM alike, is a duplicate and is ignored (logged).

Why a time window and not the sender's pid: Python's handlers do not see `si_pid`; only
`signal.sigwaitinfo` does, which needs SIGINT and SIGTERM blocked in every thread, and a
blocked mask is inherited through fork and exec (every engine core, front end, PD instance
and compiler started later would begin with its stop signals blocked), while threads that
libraries start before the mask is set (torch, tokenizers, Ray) would still take the signals.
Nor would the pid decide alone: a launcher's copy comes from another pid than the original,
but so does a user's `kill` after a terminal's Ctrl-C; a window is needed either way.

A process whose signals come from its supervisor (a front end under `--api-server-count N`,
which leaves the terminal's process group) uses `FORWARDED_WINDOW_S`: the supervisor forwards
only the signals it counted, at least `DUPLICATE_WINDOW_S` apart (the child's shorter window
leaves room for their delivery's jitter), and the window absorbs the copy that reached the
child directly: a group signal before it left the group, or systemd's SIGTERM to every process
of the service's cgroup.

Start-up: before a command started anything that must be stopped in order, `exit_at_once`
ends the process at the first signal (an import of torch in progress is not waited for); once
children run, the default action raises `StopRequested`, whose unwinding stops them.

Signals while children start: `spawning()` defers the handler's action to the end of the block
(a `StopRequested` raised between a fork and the bookkeeping of its child would leave the child
unowned) and blocks both signals in the thread that forks, so a child starts with them blocked
and pending; the child calls `install()` (its own policy) and then `unblock_stop_signals()`,
and no signal is lost or handled by the parent's handler in the child. A forked child that has
not installed its own policy ignores the parent's (the handler checks the pid).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

from rlt_serve.exit_codes import EXIT_OK, FORCED_EXIT_BASE

logger = logging.getLogger("rlt_serve.shutdown")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_WINDOW_S = 1.0  # a stop signal this soon after the last one counted is a duplicate
FORWARDED_WINDOW_S = 0.5  # the same, for a process its supervisor forwards signals to
# A server exits at most this long after the grace period of its drain (--shutdown-timeout)
# has run out; each step beyond has a bound of its own: uvicorn cancels a handler that still
# runs 5 s after the grace period, engine cores and PD instances get 10-15 s to stop before
# they are killed. Typically it exits within a second of the last request's end.
STOP_BOUND_MARGIN_S = 30.0

# A phase's response to a counted signal: action(signum, stage), stage 1 for the first.
Action = Callable[[int, int], None]


class StopRequested(BaseException):  # noqa: N818 - a request, like KeyboardInterrupt
    """Raised in the main thread by the first stop signal while a command starts up (the
    default action): the start-up unwinds through its `finally` clauses, which stop what it
    started, and the command returns `EXIT_OK`. A BaseException, so that `except Exception`
    in the start-up code does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def forced_exit_code(signum: int) -> int:
    return FORCED_EXIT_BASE + signum


class StopSignals:
    """The stop-signal policy of one process (see the module docstring). `install()` in the
    main thread, before anything starts; `restore()` (or the `with` block's end) puts the
    previous handlers back."""

    def __init__(
        self,
        *,
        duplicate_window_s: float = DUPLICATE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.duplicate_window_s = duplicate_window_s
        self.stage = 0  # signals counted (duplicates are not)
        self.signals: list[int] = []  # the signals counted, in order
        self._clock = clock
        self._last_counted = -float("inf")
        self._action: Action = interrupt_start
        self._deferring = 0
        self._deferred: list[tuple[int, int]] = []
        self._previous: dict[int, object] = {}
        self._pid: int | None = None

    # -- the policy ---------------------------------------------------------------------------
    def count(self, signum: int) -> int | None:
        """The stage this signal moves the shutdown to, or None for a duplicate."""
        # (a handler can run inside another, between two of its bytecodes: the window starts
        # before the stage moves, and nothing here assumes the two happened together)
        now = self._clock()
        since = now - self._last_counted
        if since < self.duplicate_window_s:
            logger.info(
                "%s %.2f s after %s: a duplicate (a launcher's copy), ignored",
                signal_name(signum),
                since,
                signal_name(self.signals[-1] if self.signals else signum),
            )
            return None
        self._last_counted = now
        self.signals.append(signum)
        self.stage = len(self.signals)
        return self.stage

    @property
    def forced_by(self) -> int | None:
        """The second signal counted (it cut the drain short), or None."""
        return self.signals[1] if len(self.signals) > 1 else None

    def exit_code(self) -> int:
        """`EXIT_OK`, or `forced_exit_code` once a second signal was counted."""
        forced = self.forced_by
        return EXIT_OK if forced is None else forced_exit_code(forced)

    # -- installation -------------------------------------------------------------------------
    def install(self) -> StopSignals:
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def restore(self) -> None:
        """Put the previous handlers back (an embedder's `with` block; a command calls
        `finish()`)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def finish(self) -> None:
        """The command is done. After a stop by signal, SIGINT and SIGTERM are ignored from
        now on: a launcher's copy can arrive 200 ms late, while the interpreter exits, and
        Python's own handler (KeyboardInterrupt) or, once its finalization reset the handlers
        it installed, the default action (death by the signal: exit status 130 / 143) would
        meet it; an ignored signal stays ignored through the finalization. Otherwise (the
        command failed, or it ran in a process that goes on, e.g. a test) the previous
        handlers are back."""
        if self.stage:
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            self._previous = {}
        else:
            self.restore()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.restore()

    # -- phases -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def acting(self, action: Action) -> Iterator[None]:
        """Within the block, counted signals call `action(signum, stage)` (in the main thread,
        between two bytecodes: an action that must reach an event loop uses
        `call_soon_threadsafe`)."""
        previous, self._action = self._action, action
        try:
            yield
        finally:
            self._action = previous

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Count signals within the block but act on them when it ends (under the action in
        force then)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring:
            pending, self._deferred = self._deferred, []
            for signum, stage in pending:
                self._action(signum, stage)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around starting children: actions deferred, and SIGINT/SIGTERM blocked in this
        thread, so children start with them blocked (they unblock once they installed their
        own `StopSignals`: `unblock_stop_signals`)."""
        with self.deferred():
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            try:
                yield
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _handle(self, signum: int, _frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked child before it installed its own policy: the parent decides
        stage = self.count(signum)
        if stage is None:
            return
        if self._deferring:
            self._deferred.append((signum, stage))
        else:
            self._action(signum, stage)


def interrupt_start(signum: int, stage: int) -> None:
    """The default action (start-up): the first signal raises `StopRequested` in the main
    thread; later ones arrive while the start-up unwinds, which stops its children at once."""
    if stage == 1:
        logger.info("%s during start-up: stopping", signal_name(signum))
        raise StopRequested(signum)
    logger.info("%s: stopping already", signal_name(signum))


def exit_at_once(signals: StopSignals, cleanup: Callable[[], None] = lambda: None) -> Action:
    """The action while a command starts before it started anything that must be stopped in
    order (it imports, checks its options; `cleanup` kills what it did start, e.g. a core
    still loading): the first signal ends the process at once (`os._exit`, after flushing the
    output) instead of unwinding through an import in progress, which could take seconds."""

    def act(signum: int, stage: int) -> None:
        logger.info("%s during start-up: stopping", signal_name(signum))
        cleanup()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(signals.exit_code())

    return act


def stopping(kill: Callable[[], None], what: str = "the child processes") -> Action:
    """The action while a command stops after serving (its children are being stopped): a
    second signal or more kills them at once."""

    def act(signum: int, stage: int) -> None:
        if stage >= 2:
            logger.warning("%s while stopping: killing %s", signal_name(signum), what)
            kill()
        else:
            logger.info("%s: stopping already", signal_name(signum))

    return act


def unblock_stop_signals() -> None:
    """In a child started under `StopSignals.spawning()`: deliver what was held (call it once
    the child installed its own handlers or ignores the signals)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
