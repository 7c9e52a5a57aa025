"""`rlt serve`: the engine core in its own process, front ends with the rlt-serve app in uvicorn.

    rlt serve (front end: HTTP, tokenization, output processing)  --ZeroMQ-->  engine core process
    rlt serve --api-server-count N: a supervisor, N front-end processes sharing one listening
    socket, one engine core process (rlt.serving.supervisor)

`build_server(engine)` instead runs the core on a thread of this process (tests, embedders);
both use the same `CoreClient`, `CoreLoop` and messages.

Shutdown: uvicorn turns SIGINT/SIGTERM into a graceful exit. It stops accepting connections
and waits for in-flight requests. `DrainingServer` gives them `shutdown_timeout` seconds to
finish, then shuts the core down, which aborts whatever still runs: each of those requests
still ends properly (a stream sends its last chunk with finish_reason "abort" and `[DONE]`, a
plain request answers with what it has). Should a handler hang anyway, uvicorn cancels it
after `HARD_STOP_MARGIN_S` more seconds. Then the app's lifespan shutdown runs (the client
shutdown again: a no-op once the core stopped), and `serve()` returns 0.

A second SIGINT or SIGTERM during the drain skips the rest of the grace period: the engine
aborts what still runs at once, and every request still ends properly (JSON bodies, streams
with their last chunk and `[DONE]`); `serve()` then returns 128 + that signal's number (130
for SIGINT, 143 for SIGTERM) to say the drain was cut short. A third signal stops at once
(uvicorn's forced exit: connections are dropped).

If the core process dies, every in-flight request ends with an error (a JSON 5xx body, or an
error event in a stream), /health fails, and the server exits with `EXIT_ENGINE_DIED` once
those answers went out; a supervisor (systemd, Kubernetes) restarts it. If the front end dies,
the core sees its parent's pipe close and exits too: no process is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from rlt_contracts import ConfigurationError, PDStaticInfo
from rlt_models import load_tokenizer
from rlt_serve import (
    LOOPBACK_HOSTS,
    build_app,
    is_loopback,
)
from rlt_serve.info_routes import package_version
from rlt_serve.listening import listening_socket

from rlt.engine.assembly import resolve_model_dir
from rlt.engine.config import EngineConfig
from rlt.engine.llm_engine import LLMEngine
from rlt.engine.startup import StartupClock, configure_logging
from rlt.serving.async_engine import AsyncEngine
from rlt.serving.core_client import CoreClient
from rlt.serving.core_process_client import CoreEndpoint, CoreProcess, ProcessTransport
from rlt.serving.pd_control import EnginePDControl
from rlt.serving.server_options import EXIT_ENGINE_DIED, ServeOptions

logger = logging.getLogger(__name__)


def build_server(engine: LLMEngine, options: ServeOptions):
    """(app, client) over an already built engine whose core then runs on a thread of this
    process (tests and embedders; `rlt serve` runs the core in its own process)."""
    try:
        tokenizer = engine.tokenizer
    except (OSError, ValueError) as exc:
        raise ConfigurationError("model", f"the server needs the model's tokenizer: {exc}") from exc
    pd = engine.parts.pd
    client = AsyncEngine(engine)
    return build_front_app(client, tokenizer, options, pd.static_info() if pd else None), client


def build_front_app(client: CoreClient, tokenizer, options: ServeOptions, pd: PDStaticInfo | None):
    """The rlt-serve app of one front end over its core client."""
    return build_app(
        client,
        served_model_name=options.served_model_name or client.model_info().name,
        tokenizer=tokenizer,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        loop_defaults=options.loop_defaults,
        allowed_hosts=LOOPBACK_HOSTS if is_loopback(options.host) else None,
        allowed_origins=options.allowed_origins,
        engine_error=lambda: client.dead,
        pd=EnginePDControl(client, pd),
        version=package_version("rlt"),
    )


HARD_STOP_MARGIN_S = 5.0


def uvicorn_config(app, options: ServeOptions) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        lifespan="on",
        timeout_graceful_shutdown=options.shutdown_timeout + HARD_STOP_MARGIN_S,
        server_header=False,
    )


FORCED_EXIT_BASE = 128  # exit code after a second signal: 128 + its number


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: `grace_s` seconds into a shutdown, or at once on a second
    signal, abort the requests still in flight through the engine client, so they end with
    finish_reason "abort" instead of having their connections cut. `forced_by` is the signal
    that cut the drain short (None after a full drain). `on_start` (a coroutine function)
    runs on the server's loop before it listens: a front end connects to its core there.
    `core_died()` ends the server with `EXIT_ENGINE_DIED` once the failed requests answered."""

    def __init__(
        self, config: uvicorn.Config, client: CoreClient, *, grace_s: float, on_start=None
    ) -> None:
        super().__init__(config)
        self._client = client
        self._grace_s = grace_s
        self._on_start = on_start
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_task: asyncio.Task | None = None
        self.forced_by: int | None = None
        self.engine_died = False
        self.clock = StartupClock()  # run_front_end passes the one that timed the core

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self._on_start is not None:
            await self._on_start()
        await super().startup(sockets)
        if self.started:  # the URL once it answers (the port the OS chose for --port 0)
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            self.clock.ready(f"ready at http://{self.config.host}:{port}")

    def core_died(self) -> None:
        self.engine_died = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        """Signal handler (main thread): first signal drains, second aborts, third forces."""
        if not self.should_exit:
            super().handle_exit(sig, frame)
        elif self.forced_by is None:
            self.forced_by = sig
            logger.warning(
                "%s during shutdown: aborting the requests still running",
                signal.Signals(sig).name,
            )
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._abort_in_flight)
        else:
            self.force_exit = True

    def _abort_in_flight(self) -> None:
        if self._abort_task is None:
            self._abort_task = asyncio.get_running_loop().create_task(self._client.shutdown())

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        abort = loop.call_later(self._grace_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    @property
    def exit_code(self) -> int:
        if self.engine_died:
            return EXIT_ENGINE_DIED
        return 0 if self.forced_by is None else FORCED_EXIT_BASE + self.forced_by


def serve(config: EngineConfig, options: ServeOptions, core: CoreProcess | None = None) -> int:
    """Start the engine core in its own process (or take `core`, spawned by the caller before it
    imported this module), serve until SIGINT/SIGTERM, shut down; returns the exit code: 0
    after a full drain, 128 + the signal's number when a second signal cut it short,
    `EXIT_ENGINE_DIED` when the core died. With `api_server_count` > 1 a supervisor runs that
    many front-end processes over the one core (`rlt.serving.supervisor`)."""
    if options.api_key is None and not is_loopback(options.host):
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", options.host
        )
    if options.api_server_count > 1:
        from rlt.serving.supervisor import supervise

        return supervise(config, options)
    configure_logging(options.log_level, "api")
    clock = StartupClock()
    core = core or CoreProcess.spawn(config, log_level=options.log_level)
    try:
        with clock.phase("front end: tokenizer (while the core starts)"):
            tokenizer = _tokenizer(resolve_model_dir(config.model))
        with clock.phase("engine core process ready (see its [core] lines)"):
            endpoint = core.wait_ready()
        return run_front_end(
            endpoint, options, index=0, owns_core=True, clock=clock, tokenizer=tokenizer
        )
    finally:
        core.stop()


def _tokenizer(model_dir: Path):
    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigurationError("model", f"the server needs the model's tokenizer: {exc}") from exc


def run_front_end(
    endpoint: CoreEndpoint,
    options: ServeOptions,
    *,
    index: int,
    owns_core: bool,
    sock=None,
    clock: StartupClock | None = None,
    tokenizer=None,
) -> int:
    """One front end (HTTP, tokenization, output processing) over a running core; `sock`: a
    listening socket shared by several front ends (None: bind host:port)."""
    clock = clock or StartupClock()
    model_info = endpoint.ready.model_info
    with clock.phase("front end: app"):
        if tokenizer is None:
            tokenizer = _tokenizer(Path(model_info.path))
        transport = ProcessTransport(endpoint, f"fe{index}", owns_core=owns_core)
        client = CoreClient(
            transport,
            model_info=model_info,
            stats=endpoint.ready.stats,
            tokenizer=lambda: tokenizer,
        )
        app = build_front_app(client, tokenizer, options, endpoint.ready.pd)
    server = DrainingServer(
        uvicorn_config(app, options),
        client,
        grace_s=options.shutdown_timeout,
        on_start=lambda: transport.start(client, on_core_death=lambda: server.core_died()),
    )
    server.clock = clock
    try:
        # bound here, not by uvicorn: a port taken since `rlt serve` probed it is a clear
        # ConfigurationError (exit 2), not uvicorn's exit after it logged the bind error
        sock = sock or listening_socket(options.host, options.port)
        with _signals_end_cleanly():
            server.run(sockets=[sock])
    finally:
        transport.dispose()
    return server.exit_code


class _signals_end_cleanly:
    """uvicorn handles SIGINT/SIGTERM while it runs and, after its graceful shutdown, raises
    the captured signal again under the handler that was installed before it started. With the
    default handlers that would turn a clean shutdown into a KeyboardInterrupt / exit 143, so
    during `server.run()` the previous handlers are no-ops that only log."""

    SIGNALS: Sequence[int] = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _note(signum, _frame) -> None:
        logger.info("%s: server stopped", signal.Signals(signum).name)
