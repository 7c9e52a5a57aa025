"""One front end of `rlt serve` (HTTP, tokenization, output processing) over a running engine
core: the rlt-serve app over a `CoreClient` (`build_front_app`), in uvicorn with the stop-signal
policy of every rlt server (`DrainingServer`), on its own listening socket or on one shared by
several front ends (`run_front_end`).

`rlt serve` runs one in its own process (`rlt.serving.server.serve`); with `--api-server-count
N` the supervisor (`rlt.serving.supervisor`) runs N of them as processes of their own; Ray's
ingress builds the same app (`build_front_app`). Shutdown: see `rlt.serving.server`.
"""

from __future__ import annotations

from pathlib import Path

import uvicorn
from rlt_contracts import ConfigurationError, PDStaticInfo
from rlt_models import load_tokenizer
from rlt_models.model_source import resolve_tokenizer_dir
from rlt_serve.front_options import ServeOptions
from rlt_serve.front_options import build_front_app as front_app
from rlt_serve.info_routes import package_version
from rlt_serve.listening import listening_socket
from rlt_serve.server_drain import ServerDrain
from rlt_serve.shutdown import StopSignals

from rlt.engine.assembly import resolve_model_dir
from rlt.engine.config import EngineConfig
from rlt.engine.startup import StartupClock
from rlt.serving.core_client import CoreClient
from rlt.serving.core_process_client import CoreEndpoint, ProcessTransport
from rlt.serving.pd_control import EnginePDControl
from rlt.serving.server_options import EXIT_ENGINE_DIED


def build_front_app(client: CoreClient, tokenizer, options: ServeOptions, pd: PDStaticInfo | None):
    """The rlt-serve app of one front end over its core client."""
    return front_app(
        client,
        tokenizer,
        options,
        options.front,
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


def tokenizer_source(config: EngineConfig) -> Path:
    """The directory the front ends load the tokenizer from: --tokenizer's, else the model's."""
    return resolve_tokenizer_dir(config.model.tokenizer) or resolve_model_dir(config.model.model)


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
