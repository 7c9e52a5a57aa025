"""`rlt serve`: the engine core in its own process, front ends with the rlt-serve app in uvicorn.

    rlt serve (front end: HTTP, tokenization, output processing)  --ZeroMQ-->  engine core process
    rlt serve --api-server-count N: a supervisor, N front-end processes sharing one listening
    socket, one engine core process (rlt.serving.supervisor)

`build_server(engine)` instead runs the core on a thread of this process (tests, embedders);
both use the same `CoreClient`, `CoreLoop` and messages.

Shutdown follows `rlt_serve.shutdown` (one policy for every rlt server): `rlt serve` installs
a `StopSignals` before the core starts. A stop signal during start-up stops it (the core is
killed: nothing runs yet) and `rlt serve` exits 0. While serving, `DrainingServer` routes the
signals to a `ServerDrain`: the first stops accepting connections and gives the requests in
flight `shutdown_timeout` seconds, then shuts the core down, which aborts whatever still runs:
each of those requests still ends properly (a stream sends its last chunk with finish_reason
"abort" and `[DONE]`, a plain request answers 200 with what it has). Should a handler hang
anyway, uvicorn cancels it after `HARD_STOP_MARGIN_S` more seconds. Then the app's lifespan
shutdown runs (the client shutdown again: a no-op once the core stopped), and `serve()`
returns 0. A launcher's copy of the signal (`uv run`, systemd) is not a second signal.

A second SIGINT or SIGTERM skips the rest of the grace period: the engine aborts what still
runs at once, and every request still ends properly (JSON bodies, streams with their last
chunk and `[DONE]`); `serve()` then returns 128 + that signal's number (130 for SIGINT, 143
for SIGTERM) to say the drain was cut short. A third signal stops at once (connections are
dropped; still no traceback).

If the core process dies, every in-flight request ends with an error (a JSON 5xx body, or an
error event in a stream), /health fails, and the server exits with `EXIT_ENGINE_DIED` once
those answers went out; a supervisor (systemd, Kubernetes) restarts it. If the front end dies,
the core sees its parent's pipe close and exits too: no process is left behind.
"""

from __future__ import annotations

import logging
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
from rlt_serve.server_drain import ServerDrain
from rlt_serve.shutdown import StopRequested, StopSignals, stopping

from rlt.engine.assembly import resolve_model_dir, resolve_tokenizer_dir
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
        chat_template=options.front.chat_template,
        default_seed=options.front.default_seed,
    )


HARD_STOP_MARGIN_S = 5.0


def uvicorn_config(app, options: ServeOptions) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        lifespan="on",
        timeout_graceful_shutdown=options.shutdown_timeout + HARD_STOP_MARGIN_S,
        server_header=False,
        # TLS, uvicorn's own log level (never rlt's loggers), its access log
        **options.front.uvicorn_options(options.log_level),
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the stop-signal policy of every rlt server (`ServerDrain`): the
    first signal drains, the requests still in flight `grace_s` seconds later (or at a second
    signal) are aborted through the engine client, so they end with finish_reason "abort"
    instead of having their connections cut. `on_start` (a coroutine function) runs on the
    server's loop before it listens: a front end connects to its core there. `core_died()`
    ends the server with `EXIT_ENGINE_DIED` once the failed requests answered."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: CoreClient,
        *,
        signals: StopSignals,
        grace_s: float,
        on_start=None,
    ) -> None:
        super().__init__(config)
        self.drain = ServerDrain(self, signals, grace_s=grace_s, abort=client.shutdown)
        self._on_start = on_start
        self.engine_died = False
        self.clock = StartupClock()  # run_front_end passes the one that timed the core

    def capture_signals(self):
        return self.drain.capture_signals()

    async def startup(self, sockets=None) -> None:
        if self._on_start is not None:
            await self._on_start()
        await super().startup(sockets)
        if self.started:  # the URL once it answers (the port the OS chose for --port 0)
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            scheme = "https" if self.config.is_ssl else "http"
            self.clock.ready(f"ready at {scheme}://{self.config.host}:{port}")

    def core_died(self) -> None:
        self.engine_died = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        async with self.drain.grace_period():
            await super().shutdown(sockets)

    @property
    def exit_code(self) -> int:
        if self.engine_died:
            return EXIT_ENGINE_DIED
        return self.drain.signals.exit_code()


def serve(
    config: EngineConfig,
    options: ServeOptions,
    core: CoreProcess | None = None,
    signals: StopSignals | None = None,
) -> int:
    """Start the engine core in its own process (or take `core`, spawned by the caller before it
    imported this module), serve until SIGINT/SIGTERM, shut down; returns the exit code: 0
    after a stop by signal (during start-up, or after the drain), 128 + the signal's number
    when a second signal cut the drain short, `EXIT_ENGINE_DIED` when the core died. With
    `api_server_count` > 1 a supervisor runs that many front-end processes over the one core
    (`rlt.serving.supervisor`). `signals`: the caller's installed policy (`rlt serve`
    installs it before anything starts); None: installed here, for the call."""
    if signals is None:
        with StopSignals() as owned:
            try:
                return serve(config, options, core, owned)
            except StopRequested:
                if core is not None:
                    core.kill()
                return owned.exit_code()
    if options.api_key is None and not is_loopback(options.host):
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", options.host
        )
    if options.api_server_count > 1:
        from rlt.serving.supervisor import supervise

        return supervise(config, options, signals)
    configure_logging(options.log_level, "api")
    clock = StartupClock()
    try:
        if core is None:
            with signals.spawning():
                core = CoreProcess.spawn(config, log_level=options.log_level)
        with clock.phase("front end: tokenizer (while the core starts)"):
            tokenizer = front_end_tokenizer(tokenizer_source(config))
        with clock.phase("engine core process ready (see its [core] lines)"):
            endpoint = core.wait_ready()
        return run_front_end(
            endpoint,
            options,
            index=0,
            owns_core=True,
            signals=signals,
            clock=clock,
            tokenizer=tokenizer,
        )
    except StopRequested:
        if core is not None:
            core.kill()  # still starting: nothing to drain
        raise
    finally:
        if core is not None:
            with signals.acting(stopping(core.kill, "the engine core")):
                core.stop()


def tokenizer_source(config: EngineConfig) -> Path:
    """The directory the front ends load the tokenizer from: --tokenizer's, else the model's."""
    return resolve_tokenizer_dir(config.tokenizer) or resolve_model_dir(config.model)


def front_end_tokenizer(model_dir: Path):
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
    signals: StopSignals,
    sock=None,
    clock: StartupClock | None = None,
    tokenizer=None,
    tokenizer_dir: Path | None = None,
) -> int:
    """One front end (HTTP, tokenization, output processing) over a running core; `sock`: a
    listening socket shared by several front ends (None: bind host:port). `signals`: the
    process's installed stop-signal policy (a signal before the server runs raises
    `StopRequested`). `tokenizer`: already loaded; else loaded from `tokenizer_dir` (None: the
    model directory the core serves)."""
    clock = clock or StartupClock()
    model_info = endpoint.ready.model_info
    with clock.phase("front end: app"):
        if tokenizer is None:
            tokenizer = front_end_tokenizer(tokenizer_dir or Path(model_info.path))
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
        signals=signals,
        grace_s=options.shutdown_timeout,
        on_start=lambda: transport.start(client, on_core_death=lambda: server.core_died()),
    )
    server.clock = clock
    try:
        # bound here, not by uvicorn: a port taken since `rlt serve` probed it is a clear
        # ConfigurationError (exit 2), not uvicorn's exit after it logged the bind error
        sock = sock or listening_socket(options.host, options.port)
        # from here a stop signal drains (before uvicorn listens: it stops right after)
        with signals.acting(server.drain.act):
            server.run(sockets=[sock])
    finally:
        transport.dispose()
    return server.exit_code
