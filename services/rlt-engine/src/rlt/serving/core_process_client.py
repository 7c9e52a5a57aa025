"""Start the engine-core process and talk to it from a front end (M1 side of `core_process.py`).

`CoreProcess.start(config)` forks the core (spawns it for a CUDA engine), waits for its
`CoreReady` (or raises the typed error that stopped it) and keeps the pipes of the liveness
rules (see `rlt.engine.core_process`). A front end then gets a `ProcessTransport` over the
core's socket:

    front end event loop                          core process
    --------------------                          ------------
    send(CoreInput) --DEALER, msgpack-->          ROUTER
    reader task     <--CoreOutputs--------        one per round
    add_reader(core_alive) fires at EOF  <----    the process ended (any cause)

A front end that owns the core (`rlt serve` with one API server) shuts it down on `close()`;
with several API servers each one only aborts its own requests and the supervisor stops the
core once every front end has exited.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from rlt_contracts import (
    CoreAbort,
    CoreOutputs,
    CoreReady,
    CoreShutdown,
    EngineDeadError,
    WireError,
    raise_wire_error,
)

from rlt.engine.config import EngineConfig
from rlt.engine.core_process import run_core_process

logger = logging.getLogger(__name__)

CORE_EXIT_WAIT_S = 10.0  # how long a stopping core may take before it is killed


@dataclass
class CoreEndpoint:
    """What a front end needs to reach a running core (picklable: passed to API-server
    processes)."""

    address: str
    ready: CoreReady
    core_alive: object  # multiprocessing Connection: read end, EOF when the core exits


def child_start_method(config: EngineConfig) -> str:
    """ "fork" for a CPU engine (the child starts at once, without importing everything again);
    "spawn" for CUDA: the CUDA driver does not survive a fork once this process asked it
    anything (as resolving device "auto" does)."""
    return "fork" if config.runner.device == "cpu" else "spawn"


class CoreProcess:
    """A spawned engine core, owned by the process that started it."""

    def __init__(self, process, address: str, pipes: tuple, directory) -> None:
        self.process = process
        self._address = address
        self._ready, self._parent_alive, self._core_alive = pipes
        self._directory = directory  # holds the ipc socket
        self._endpoint: CoreEndpoint | None = None

    @classmethod
    def start(
        cls, config: EngineConfig, *, log_level: str = "info", timeout_s: float | None = None
    ) -> CoreProcess:
        """Spawn the core and wait until it serves."""
        core = cls.spawn(config, log_level=log_level)
        core.wait_ready(timeout_s)
        return core

    @classmethod
    def spawn(
        cls, config: EngineConfig, *, log_level: str = "info", start_method: str | None = None
    ) -> CoreProcess:
        """Start the core process and return at once (`wait_ready` waits for it): the caller
        can prepare its front end while the core builds the engine. `start_method`: None
        chooses by device (`child_start_method`); a caller with threads running (a Ray
        replica) passes "spawn", since a fork copies their locks in whatever state they are."""
        context = multiprocessing.get_context(start_method or child_start_method(config))
        directory = tempfile.TemporaryDirectory(prefix="rlt-core-")
        address = f"ipc://{directory.name}/core.sock"
        ready_r, ready_w = context.Pipe(duplex=False)
        parent_r, parent_w = context.Pipe(duplex=False)
        alive_r, alive_w = context.Pipe(duplex=False)
        process = context.Process(
            target=run_core_process,
            args=(config, address, ready_w, parent_r, alive_w, log_level, (ready_r, parent_w)),
            name="rlt-engine-core",
        )
        process.start()
        for end in (ready_w, parent_r, alive_w):  # the child holds these now
            end.close()
        return cls(process, address, (ready_r, parent_w, alive_r), directory)

    def wait_ready(self, timeout_s: float | None = None) -> CoreEndpoint:
        """Wait for the core's `CoreReady`; raise the typed error that stopped it (or
        EngineDeadError when it exited or took longer than `timeout_s`)."""
        if self._endpoint is not None:
            return self._endpoint
        process, ready = self.process, self._ready
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ready.poll(0.1):
            if not process.is_alive() or (deadline is not None and time.monotonic() > deadline):
                process.kill()
                process.join()
                self._directory.cleanup()
                raise EngineDeadError(
                    f"the engine core exited while starting (exit code {process.exitcode})"
                )
        kind, payload = ready.recv()
        ready.close()
        if kind == "error":
            process.join(CORE_EXIT_WAIT_S)
            self._directory.cleanup()
            raise_wire_error(msgspec.msgpack.decode(payload, type=WireError))
        core_ready = msgspec.msgpack.decode(payload, type=CoreReady)
        self._endpoint = CoreEndpoint(self._address, core_ready, self._core_alive)
        return self._endpoint

    @property
    def is_ready(self) -> bool:
        """The core reported `CoreReady` (`wait_ready` returned)."""
        return self._endpoint is not None

    @property
    def endpoint(self) -> CoreEndpoint:
        return self.wait_ready()

    def parent_only(self) -> tuple:
        """Pipe ends a forked child of this process must close (it would otherwise keep the
        core's parent pipe open after this process died)."""
        return (self._parent_alive,)

    def stop(self, timeout_s: float = CORE_EXIT_WAIT_S) -> int | None:
        """Wait for the core to exit (a `CoreShutdown` went out), closing the parent pipe so
        it stops even without one; kill it after `timeout_s`. Returns its exit code."""
        self._parent_alive.close()
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %.0f s: killing it", timeout_s)
            self.process.kill()
            self.process.join()
        self._directory.cleanup()
        return self.process.exitcode

    def kill(self) -> None:
        """Stop the core at once, however far its start-up got (a stop signal during start-up:
        nothing runs on it yet). Idempotent; `stop()` after it returns at once."""
        self._parent_alive.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._directory.cleanup()


class ProcessTransport:
    """A front end's connection to the core: `send`, a reader task, the liveness watch."""

    def __init__(self, endpoint: CoreEndpoint, identity: str, *, owns_core: bool) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._owns_core = owns_core
        self._encoder = msgspec.msgpack.Encoder()
        self._socket = None
        self._context = None
        self._reader: asyncio.Task | None = None
        self._core_gone = asyncio.Event()
        self._client = None
        self._on_core_death: Callable[[], None] | None = None
        self._closing_core = False

    async def start(self, client, on_core_death: Callable[[], None] | None = None) -> None:
        """Connect (on the front end's event loop) and start delivering to `client`."""
        import zmq
        import zmq.asyncio

        self._client = client
        self._on_core_death = on_core_death
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self._identity.encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self._endpoint.address)
        self._socket = socket
        loop = asyncio.get_running_loop()
        loop.add_reader(self._endpoint.core_alive.fileno(), self._core_exited)
        self._reader = loop.create_task(self._read(), name=f"rlt-core-reader-{self._identity}")

    async def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreOutputs)
        while True:
            payload = await self._socket.recv(copy=False)
            try:
                self._client.on_outputs(decoder.decode(payload.buffer))
            except Exception:  # noqa: BLE001 - a bug for one round must not stop the reader
                logger.exception("the front end failed to apply one round of the core's outputs")

    def _core_exited(self) -> None:
        """The core's liveness pipe reached EOF: it exited (crash, kill, or a shutdown)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._endpoint.core_alive.fileno())
        loop.create_task(self._after_core_exit())

    async def _after_core_exit(self) -> None:
        await asyncio.sleep(0.05)  # outputs the core sent before exiting are read first
        if self._reader is not None:
            self._reader.cancel()
        self._core_gone.set()
        self._client.on_dead(EngineDeadError("the engine core process exited"))
        if self._on_core_death is not None and not self._closing_core:
            logger.error("the engine core process died: stopping this server")
            self._on_core_death()

    def send(self, message) -> None:
        if self._socket is None or self._core_gone.is_set():
            raise EngineDeadError("the engine core is not running")
        self._socket.send(self._encoder.encode(message), copy=False)

    async def close(self) -> None:
        """Owner: shut the core down (what runs is aborted and reported), wait for its exit.
        Otherwise: abort this front end's requests (their final deltas still arrive)."""
        if self._core_gone.is_set() or self._socket is None:
            return
        if self._owns_core:
            self._closing_core = True
            self.send(CoreShutdown())
            try:
                await asyncio.wait_for(self._core_gone.wait(), CORE_EXIT_WAIT_S)
            except TimeoutError:
                logger.warning("the engine core did not confirm its shutdown")
        else:
            live = tuple(self._client.live_request_ids())
            if live:
                self.send(CoreAbort(live))
                await self._client.wait_finished(live, CORE_EXIT_WAIT_S)

    def dispose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close(0)
        if self._context is not None:
            self._context.term()
