"""`rlt serve --api-server-count N`: N front-end processes over one engine-core process.

    supervisor (this process: binds the port, starts and watches the others, serves nothing)
      |-- engine core process           one ROUTER socket; front end i is DEALER "fe<i>"
      |-- front end 0 .. N-1            uvicorn on the one shared listening socket (the kernel
                                        hands each new connection to one of them)

The supervisor waits on every child's sentinel: a dead front end is reported to the core
(`CoreClientGone`) and replaced on the same socket; a dead core makes every front end exit and
then the supervisor, with `EXIT_ENGINE_DIED` (docs/serving.md, "Processes and failures").

Signals follow `rlt_serve.shutdown`: every signal the supervisor counts is forwarded to each
front end, which drains as `rlt serve` does. The front ends leave the terminal's process
group, so that they get each signal once, from the supervisor, and start with the signals
blocked (`StopSignals.spawning`) until their own policy is installed. Front ends still running
`FRONT_END_STOP_MARGIN_S` after the grace period are killed; the core is then stopped by
closing its parent pipe. No zmq (nor any other lazy import) runs on the way out.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from multiprocessing.connection import wait

import msgspec
import zmq
from rlt_contracts import CoreClientGone
from rlt_models.model_source import resolve_tokenizer_dir
from rlt_serve.listening import listening_socket
from rlt_serve.shutdown import (
    FORWARDED_WINDOW_S,
    StopRequested,
    StopSignals,
    signal_name,
    stopping,
    unblock_stop_signals,
)

from rlt.engine.config import EngineConfig
from rlt.engine.startup import StartupClock, configure_logging
from rlt.serving.core_process_client import (
    CORE_EXIT_WAIT_S,
    CoreEndpoint,
    CoreProcess,
    child_start_method,
)
from rlt.serving.front_end import front_end_tokenizer, run_front_end, tokenizer_source
from rlt.serving.front_end_metrics import FrontEndMetrics
from rlt.serving.server_options import EXIT_ENGINE_DIED

logger = logging.getLogger(__name__)

# beyond the grace period: how long stopping front ends may take (uvicorn cancels a hung
# handler 5 s after it; a front end then aborts its own requests in the core) before the
# supervisor kills them
FRONT_END_STOP_MARGIN_S = 10.0
SENTINEL_POLL_S = 0.5  # the wait for children wakes this often to check the stop deadline


def _run_front_end(
    endpoint: CoreEndpoint,
    options,
    index: int,
    sock: socket.socket,
    parent_only: tuple,
    tokenizer=None,
    tokenizer_dir=None,
) -> None:
    """Entry point of a front-end process (forked, or spawned), started with SIGINT/SIGTERM
    blocked: it leaves the terminal's process group (a group signal reaches it once, forwarded
    by the supervisor), installs its own stop-signal policy, then takes what was held."""
    os.setpgrp()
    signals = StopSignals(duplicate_window_s=FORWARDED_WINDOW_S).install()
    unblock_stop_signals()
    for end in parent_only:
        end.close()
    configure_logging(options.log_level, f"fe{index}")
    try:
        code = run_front_end(
            endpoint,
            options,
            index=index,
            owns_core=False,
            signals=signals,
            sock=sock,
            tokenizer=tokenizer,
            tokenizer_dir=tokenizer_dir,
        )
    except StopRequested:
        code = signals.exit_code()
    signals.finish()
    raise SystemExit(code)


class _Supervisor:
    def __init__(self, config: EngineConfig, options, signals: StopSignals) -> None:
        self.config = config
        self.options = options
        self.signals = signals
        self.context = multiprocessing.get_context(child_start_method(config))
        self.core: CoreProcess | None = None
        self.sock: socket.socket | None = None
        self.front_ends: dict[int, multiprocessing.Process] = {}
        self.tokenizer = None  # for forked front ends
        self.clock = StartupClock()
        self.stop_deadline: float | None = None  # set by the first stop signal
        self._control = None  # a DEALER to the core for CoreClientGone
        self.metrics: FrontEndMetrics | None = None  # made before the front ends start

    def start_core(self) -> None:
        """Start the core and wait until it serves (a stop signal raises `StopRequested`),
        then bind the port: a forked core must not hold the listening socket."""
        with self.signals.spawning():
            self.core = CoreProcess.spawn(self.config, log_level=self.options.log_level)
        if self.context.get_start_method() == "fork":
            # forked front ends inherit it: loaded once, while the core starts, instead of by
            # every front end after it (spawned ones load their own)
            with self.clock.phase("tokenizer for the front ends (while the core starts)"):
                self.tokenizer = front_end_tokenizer(tokenizer_source(self.config))
        with self.clock.phase("engine core process ready (see its [core] lines)"):
            self.core.wait_ready()
        # `rlt serve` probed the port before this: a failure here is a race
        self.sock = listening_socket(self.options.host, self.options.port)
        self.sock.listen()

    def start_front_end(self, index: int) -> None:
        with self.signals.spawning():
            process = self.context.Process(
                target=_run_front_end,
                args=(
                    self.core.endpoint,
                    self.options,
                    index,
                    self.sock,
                    self.core.parent_only(),
                    self.tokenizer,
                    resolve_tokenizer_dir(self.config.model.tokenizer),
                ),
                name=f"rlt-api-server-{index}",
            )
            process.start()
            self.front_ends[index] = process

    def tell_core(self, message) -> None:
        if self._control is None:
            self._control = zmq.Context.instance().socket(zmq.DEALER)
            self._control.setsockopt(zmq.IDENTITY, b"supervisor")
            self._control.setsockopt(zmq.LINGER, 1000)
            self._control.connect(self.core.endpoint.address)
        self._control.send(msgspec.msgpack.encode(message))

    def on_signal(self, signum: int, stage: int) -> None:
        """The serving phase's action: forward the signal (the front ends drain, then end
        their requests at once); from the third on, kill them."""
        name = signal_name(signum)
        if stage == 1:
            self.stop_deadline = (
                time.monotonic() + self.options.shutdown_timeout + FRONT_END_STOP_MARGIN_S
            )
            logger.info("%s: stopping the API servers", name)
            if self.sock is not None:  # no front end starts any more: the port closes with
                self.sock.close()  # theirs (new connections are refused, not left waiting)
                self.sock = None
        if stage >= 3:
            logger.warning("%s: killing the API servers", name)
            self.kill_front_ends()
            return
        for process in self.front_ends.values():
            if process.is_alive():
                os.kill(process.pid, signum)

    def run(self) -> int:
        self.metrics = FrontEndMetrics()
        with self.signals.acting(self.on_signal):
            for index in range(self.options.api_server_count):
                if self.signals.stage:
                    break  # stopped while the others started: they have the signal
                self.start_front_end(index)
            # each front end logs its URL once it answers (`ready at`), after the core loaded
            logger.info(
                "start-up: %d API servers starting over one engine core",
                self.options.api_server_count,
            )
            return self._watch()

    def _watch(self) -> int:
        core_died = False
        core_sentinel = [self.core.process.sentinel]  # emptied once the core is gone
        while self.front_ends:
            sentinels = {p.sentinel: i for i, p in self.front_ends.items()}
            ready = wait([*sentinels, *core_sentinel], timeout=SENTINEL_POLL_S)
            if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                logger.warning("API servers still running after their drain: killing them")
                self.kill_front_ends()
                self.stop_deadline = None
            if core_sentinel and core_sentinel[0] in ready:
                core_sentinel.clear()
                if self.signals.stage == 0:
                    logger.error("the engine core process died: stopping the API servers")
                    core_died = True
            for sentinel in ready:
                index = sentinels.get(sentinel)
                if index is None:
                    continue
                process = self.front_ends.pop(index)
                process.join()
                self.metrics.front_end_gone(process.pid)
                logger.info("API server %d exited with code %s", index, process.exitcode)
                if self.signals.stage or core_died or not self.core.process.is_alive():
                    continue
                logger.error(
                    "API server %d exited (code %s): its requests are aborted; restarting it",
                    index,
                    process.exitcode,
                )
                self.tell_core(CoreClientGone(f"fe{index}"))
                self.start_front_end(index)
        return EXIT_ENGINE_DIED if core_died else self.signals.exit_code()

    def kill_front_ends(self) -> None:
        for process in self.front_ends.values():
            if process.is_alive():
                process.kill()

    def kill_all(self) -> None:
        self.kill_front_ends()
        if self.core is not None:
            self.core.process.kill()

    def close(self) -> None:
        """Stop what is left: front ends (killed: after a drain they are gone already), then the
        core (its parent pipe closes: it aborts what still runs and exits; killed if it still
        starts)."""
        self.kill_front_ends()
        for process in self.front_ends.values():
            process.join()
        if self.core is not None:
            if self.core.is_ready:
                self.core.stop(CORE_EXIT_WAIT_S)
            else:
                self.core.kill()
        if self._control is not None:
            self._control.close(linger=0)
        if self.sock is not None:
            self.sock.close()
        if self.metrics is not None:
            self.metrics.close()


def supervise(config: EngineConfig, options, signals: StopSignals) -> int:
    """Run the core and `options.api_server_count` front ends until a stop signal (the
    caller installed `signals`); returns the exit code (`rlt_serve.shutdown`)."""
    configure_logging(options.log_level, "supervisor")
    supervisor = _Supervisor(config, options, signals)
    try:
        supervisor.start_core()
        return supervisor.run()
    except StopRequested:  # while the core started: nothing served yet
        return signals.exit_code()
    finally:
        with signals.acting(stopping(supervisor.kill_all, "the API servers and the core")):
            supervisor.close()
