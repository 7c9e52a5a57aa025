"""`rlt serve --api-server-count N`: N front-end processes over one engine-core process.

    supervisor (this process: binds the port, starts and watches the others, serves nothing)
      |-- engine core process           one ROUTER socket; front end i is DEALER "fe<i>"
      |-- front end 0 .. N-1            uvicorn on the one shared listening socket (the kernel
                                        hands each new connection to one of them)

The supervisor waits on every child's sentinel:
- a front end dies: the core is told (`CoreClientGone`), aborts that front end's requests and
  frees their KV; a new front end takes its place on the same socket.
- the core dies: every front end sees its liveness pipe close, ends its in-flight requests
  with errors and exits; the supervisor then exits with `EXIT_ENGINE_DIED`.
- SIGINT/SIGTERM: forwarded to the front ends, which drain as `rlt serve` does; then the core
  is shut down. A second signal is forwarded too (it cuts their drains short).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import wait

import msgspec
from rlt_contracts import ConfigurationError, CoreClientGone, CoreShutdown
from rlt_serve.listening import listening_socket

from rlt.engine.config import EngineConfig
from rlt.engine.startup import configure_logging
from rlt.serving.core_process_client import (
    CORE_EXIT_WAIT_S,
    CoreEndpoint,
    CoreProcess,
    child_start_method,
)
from rlt.serving.server_options import EXIT_ENGINE_DIED

logger = logging.getLogger(__name__)

FRONT_END_EXIT_WAIT_S = 30.0  # beyond the drain: how long a stopping front end may take


def _run_front_end(
    endpoint: CoreEndpoint, options, index: int, sock: socket.socket, parent_only: tuple
) -> None:
    """Entry point of a front-end process (forked, or spawned). It drops the supervisor's signal
    handlers and leaves the terminal's process group, so a Ctrl-C reaches it once, forwarded by
    the supervisor, not twice (which would cut its drain short)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setpgrp()
    for end in parent_only:
        end.close()
    configure_logging(options.log_level, f"fe{index}")
    from rlt.serving.server import run_front_end

    raise SystemExit(run_front_end(endpoint, options, index=index, owns_core=False, sock=sock))


class _Supervisor:
    def __init__(self, config: EngineConfig, options) -> None:
        self.options = options
        self.context = multiprocessing.get_context(child_start_method(config))
        # the core first: a forked core must not hold the listening socket
        self.core = CoreProcess.start(config, log_level=options.log_level)
        try:  # `rlt serve` probed the port before this: a failure here is a race
            self.sock = listening_socket(options.host, options.port)
            self.sock.listen()
        except (ConfigurationError, OSError):
            self.core.stop()
            raise
        self.front_ends: dict[int, multiprocessing.Process] = {}
        self.stopping = 0  # signals received
        self._control = None  # a DEALER to the core for CoreClientGone / CoreShutdown

    def start_front_end(self, index: int) -> None:
        process = self.context.Process(
            target=_run_front_end,
            args=(self.core.endpoint, self.options, index, self.sock, self.core.parent_only()),
            name=f"rlt-api-server-{index}",
        )
        process.start()
        self.front_ends[index] = process

    def tell_core(self, message) -> None:
        import zmq

        if self._control is None:
            self._control = zmq.Context.instance().socket(zmq.DEALER)
            self._control.setsockopt(zmq.IDENTITY, b"supervisor")
            self._control.setsockopt(zmq.LINGER, 1000)
            self._control.connect(self.core.endpoint.address)
        self._control.send(msgspec.msgpack.encode(message))

    def on_signal(self, signum, _frame) -> None:
        self.stopping += 1
        logger.info("%s: stopping the API servers", signal.Signals(signum).name)
        for process in self.front_ends.values():
            if process.is_alive():
                os.kill(process.pid, signum)

    def run(self) -> int:
        for index in range(self.options.api_server_count):
            self.start_front_end(index)
        # each front end logs its URL once it answers (`ready at`), after the core loaded
        logger.info(
            "start-up: %d API servers starting over one engine core",
            self.options.api_server_count,
        )
        exit_code = 0
        core_sentinel = [self.core.process.sentinel]  # emptied once the core is gone
        while self.front_ends:
            sentinels = {p.sentinel: i for i, p in self.front_ends.items()}
            ready = wait([*sentinels, *core_sentinel])
            if core_sentinel and core_sentinel[0] in ready:
                core_sentinel.clear()
                if self.stopping == 0:
                    logger.error("the engine core process died: stopping the API servers")
                    exit_code = EXIT_ENGINE_DIED
                    self.stopping = 1
            for sentinel in ready:
                index = sentinels.get(sentinel)
                if index is None:
                    continue
                process = self.front_ends.pop(index)
                process.join()
                logger.info("API server %d exited with code %s", index, process.exitcode)
                if self.stopping or not self.core.process.is_alive():
                    # a drain cut short (128 + signal) is reported; a front end stopped
                    # by the forwarded signal before it served (a negative code) is not
                    exit_code = exit_code or max(process.exitcode or 0, 0)
                    continue
                logger.error(
                    "API server %d exited (code %s): its requests are aborted; restarting it",
                    index,
                    process.exitcode,
                )
                self.tell_core(CoreClientGone(f"fe{index}"))
                self.start_front_end(index)
        return exit_code

    def close(self) -> None:
        for process in self.front_ends.values():
            process.kill()
        if self.core.process.is_alive():
            try:
                self.tell_core(CoreShutdown())
            except Exception:  # noqa: BLE001 - stop() kills it anyway
                pass
        self.core.stop(CORE_EXIT_WAIT_S)
        if self._control is not None:
            self._control.close(linger=0)
        self.sock.close()


def supervise(config: EngineConfig, options) -> int:
    configure_logging(options.log_level, "supervisor")
    supervisor = _Supervisor(config, options)
    previous = {
        sig: signal.signal(sig, supervisor.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        supervisor.close()
