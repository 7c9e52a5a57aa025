"""The stop-signal policy of every rlt server (`rlt_serve.shutdown`) and its serving phase
(`rlt_serve.server_drain`), in one process: which signals count, what each stage does, the
signals held while children start, and the drain's steps on a stand-in for uvicorn.
(The commands themselves are stopped with real signals in tests/test_server_shutdown.py.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading

import pytest
from rlt_serve.server_drain import ServerDrain
from rlt_serve.shutdown import (
    DUPLICATE_WINDOW_S,
    EXIT_OK,
    FORWARDED_WINDOW_S,
    StopRequested,
    StopSignals,
    unblock_stop_signals,
)

main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers are installed from the main thread",
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_signal_within_the_window_of_the_last_one_counted_is_a_duplicate():
    clock = Clock()
    signals = StopSignals(clock=clock)
    assert signals.count(signal.SIGINT) == 1
    clock.now += 0.2  # uv's copy of a SIGINT to the process group
    assert signals.count(signal.SIGINT) is None
    clock.now += 0.5  # a SIGTERM as well (systemd and uv): still the same stop
    assert signals.count(signal.SIGTERM) is None
    assert signals.exit_code() == EXIT_OK and signals.forced_by is None
    clock.now += DUPLICATE_WINDOW_S  # the user's second signal, after the first was handled
    assert signals.count(signal.SIGTERM) == 2
    clock.now += 0.1
    assert signals.count(signal.SIGTERM) is None
    assert signals.forced_by == signal.SIGTERM
    assert signals.exit_code() == 128 + signal.SIGTERM
    clock.now += DUPLICATE_WINDOW_S
    assert signals.count(signal.SIGINT) == 3
    assert signals.signals == [signal.SIGINT, signal.SIGTERM, signal.SIGINT]


def test_forwarded_signals_a_window_apart_count_despite_jitter():
    """A supervisor forwards the signals it counted, a window apart at least; its child's
    shorter window counts each even when the second arrives a little early."""
    clock = Clock()
    signals = StopSignals(duplicate_window_s=FORWARDED_WINDOW_S, clock=clock)
    assert signals.count(signal.SIGINT) == 1
    clock.now += 0.1  # the copy that reached the child directly (systemd's cgroup kill)
    assert signals.count(signal.SIGINT) is None
    clock.now += DUPLICATE_WINDOW_S - 0.2  # the supervisor's second, delivered early
    assert signals.count(signal.SIGINT) == 2


@main_thread_only
def test_the_first_signal_of_a_start_up_raises_stop_requested():
    before = signal.getsignal(signal.SIGINT)
    signals = StopSignals().install()
    try:
        with pytest.raises(StopRequested) as stopped:
            signal.raise_signal(signal.SIGTERM)
        assert stopped.value.signum == signal.SIGTERM and signals.stage == 1
        signal.raise_signal(signal.SIGTERM)  # a duplicate: nothing
        assert signals.stage == 1
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before


@main_thread_only
def test_a_phase_acts_on_counted_signals_and_a_deferred_block_acts_at_its_end():
    clock = Clock()
    seen: list[tuple[int, int]] = []
    signals = StopSignals(clock=clock).install()
    try:
        with signals.acting(lambda signum, stage: seen.append((signum, stage))):
            with signals.deferred():
                signal.raise_signal(signal.SIGINT)
                assert seen == [] and signals.stage == 1
            assert seen == [(signal.SIGINT, 1)]
            clock.now += DUPLICATE_WINDOW_S
            signal.raise_signal(signal.SIGTERM)
            assert seen == [(signal.SIGINT, 1), (signal.SIGTERM, 2)]
    finally:
        signals.restore()


@main_thread_only
def test_finish_ignores_later_signals_after_a_stop_and_restores_the_handlers_otherwise():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    quiet = StopSignals().install()
    quiet.finish()
    assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    stopped = StopSignals().install()
    try:
        with stopped.acting(lambda signum, stage: None):
            signal.raise_signal(signal.SIGINT)
        stopped.finish()  # a launcher's late copy must not kill the exiting interpreter
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _report_mask(connection) -> None:
    connection.send(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    unblock_stop_signals()
    connection.send(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))


@main_thread_only
def test_children_started_while_spawning_hold_the_stop_signals_until_they_unblock():
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    signals = StopSignals().install()
    try:
        with signals.spawning():
            child = context.Process(target=_report_mask, args=(send,))
            child.start()
        assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
        held, released = receive.recv(), receive.recv()
        child.join(10)
    finally:
        signals.restore()
    assert {signal.SIGINT, signal.SIGTERM} <= set(held)
    assert not {signal.SIGINT, signal.SIGTERM} & set(released)


class FakeLifespan:
    def __init__(self) -> None:
        self.stopped = False

    async def shutdown(self) -> None:
        self.stopped = True


class FakeServer:
    """uvicorn's flags and lifespan, which `ServerDrain` uses."""

    def __init__(self) -> None:
        self.should_exit = False
        self.force_exit = False
        self.lifespan = FakeLifespan()


def _drain(grace_s: float) -> tuple[FakeServer, ServerDrain, list[float]]:
    server, aborted = FakeServer(), []

    async def abort() -> None:
        aborted.append(asyncio.get_running_loop().time())

    return server, ServerDrain(server, StopSignals(), grace_s=grace_s, abort=abort), aborted


def test_the_drain_aborts_what_still_runs_when_its_grace_period_ends():
    server, drain, aborted = _drain(grace_s=0.2)

    async def main() -> float:
        with drain.capture_signals():
            drain.act(signal.SIGINT, 1)
            assert server.should_exit and not aborted
            started = asyncio.get_running_loop().time()
            async with drain.grace_period():
                await asyncio.sleep(0.5)  # uvicorn waits for the requests in flight
            return started

    started = asyncio.run(main())
    assert len(aborted) == 1 and aborted[0] - started >= 0.2
    assert not server.force_exit and not server.lifespan.stopped


def test_a_second_signal_aborts_at_once_and_a_third_forces_with_the_lifespan_shut_down():
    server, drain, aborted = _drain(grace_s=600)

    async def main() -> None:
        with drain.capture_signals():
            drain.act(signal.SIGINT, 1)
            async with drain.grace_period():
                drain.act(signal.SIGINT, 2)
                await asyncio.sleep(0.05)
                assert len(aborted) == 1
                drain.act(signal.SIGTERM, 3)
                assert server.force_exit

    asyncio.run(main())
    assert len(aborted) == 1 and server.lifespan.stopped


def test_a_second_signal_before_the_loop_runs_aborts_at_the_start_of_the_drain():
    server, drain, aborted = _drain(grace_s=600)
    drain.act(signal.SIGINT, 1)
    drain.act(signal.SIGINT, 2)  # uvicorn not started yet

    async def main() -> None:
        async with drain.grace_period():
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert server.should_exit and len(aborted) == 1
