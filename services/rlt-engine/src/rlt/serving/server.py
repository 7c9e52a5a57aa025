"""`rlt serve`: wire an `LLMEngine`, its `AsyncEngine` and the rlt-serve app into uvicorn.

Shutdown: uvicorn turns SIGINT/SIGTERM into a graceful exit. It stops accepting connections
and waits for in-flight requests. `DrainingServer` gives them `shutdown_timeout` seconds to
finish, then shuts the `AsyncEngine` down, which aborts whatever still runs: each of those
requests still ends properly (a stream sends its last chunk with finish_reason "abort" and
`[DONE]`, a plain request answers with what it has). Should a handler hang anyway, uvicorn
cancels it after `HARD_STOP_MARGIN_S` more seconds. Then the app's lifespan shutdown runs
(the client shutdown again: a no-op that joins the engine thread), and `serve()` returns 0.

A second SIGINT or SIGTERM during the drain skips the rest of the grace period: the engine
aborts what still runs at once, and every request still ends properly (JSON bodies, streams
with their last chunk and `[DONE]`); `serve()` then returns 128 + that signal's number (130
for SIGINT, 143 for SIGTERM) to say the drain was cut short. A third signal stops at once
(uvicorn's forced exit: connections are dropped).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

import uvicorn
from rlt_contracts import ConfigurationError, InvalidRequestError, SamplingParams
from rlt_serve import (
    DEFAULT_MAX_BODY_BYTES,
    LOOPBACK_HOSTS,
    LoopDefaults,
    build_app,
    is_loopback,
)
from rlt_serve.info_routes import package_version

from rlt.engine.config import EngineConfig
from rlt.engine.llm_engine import LLMEngine
from rlt.serving.async_engine import AsyncEngine
from rlt.serving.pd_control import EnginePDControl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """HTTP-side options of `rlt serve` (engine options live in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model directory's name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    loop_defaults: LoopDefaults = field(default_factory=LoopDefaults)
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 10.0
    log_level: str = "info"


def build_server(engine: LLMEngine, options: ServeOptions):
    """(app, async_engine) over an already built engine; the caller runs the app."""
    try:
        tokenizer = engine.tokenizer
    except (OSError, ValueError) as exc:
        raise ConfigurationError("model", f"the server needs the model's tokenizer: {exc}") from exc
    defaults = options.loop_defaults
    try:  # the loop defaults must suit this model, or every request would fail
        SamplingParams(
            min_loops=defaults.min_loops,
            max_loops=defaults.max_loops,
            exit_threshold=defaults.exit_threshold,
        ).resolve_max_loops(engine.model_info().num_loops)
    except InvalidRequestError as exc:
        raise ConfigurationError(exc.field, f"loop default: {exc.message}") from None
    client = AsyncEngine(engine)
    app = build_app(
        client,
        served_model_name=options.served_model_name or client.model_info().name,
        tokenizer=tokenizer,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        loop_defaults=options.loop_defaults,
        allowed_hosts=LOOPBACK_HOSTS if is_loopback(options.host) else None,
        allowed_origins=options.allowed_origins,
        engine_error=lambda: client.dead,
        pd=EnginePDControl(client, engine.parts.pd),
        version=package_version("rlt"),
    )
    return app, client


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
    that cut the drain short (None after a full drain)."""

    def __init__(self, config: uvicorn.Config, client: AsyncEngine, *, grace_s: float) -> None:
        super().__init__(config)
        self._client = client
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_task: asyncio.Task | None = None
        self.forced_by: int | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            logger.info("start-up: ready at http://%s:%d", self.config.host, self.config.port)

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
        return 0 if self.forced_by is None else FORCED_EXIT_BASE + self.forced_by


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut down; returns the exit code: 0
    after a full drain, 128 + the signal's number when a second signal cut it short."""
    if options.api_key is None and not is_loopback(options.host):
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", options.host
        )
    engine = LLMEngine(config)
    app, client = build_server(engine, options)
    server = DrainingServer(uvicorn_config(app, options), client, grace_s=options.shutdown_timeout)
    try:
        with _signals_end_cleanly():
            server.run()  # (a port it cannot bind ends it with SystemExit(1))
    finally:
        client.close(timeout=options.shutdown_timeout)
        if client.stopped:
            engine.shutdown()  # (a PD instance deregisters its memory from NIXL here)
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
