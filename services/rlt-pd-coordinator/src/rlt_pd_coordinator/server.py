"""The coordinator process: instances (started or connected), the OpenAI front, shutdown.

`Coordinator.start()` starts the local instances while the tokenizer loads, admits every
instance and builds the front; `serve()` runs it under uvicorn; `close()` aborts what is in
flight and stops the children. `run(options)` does all of it under the stop-signal policy of
every rlt server (`rlt_serve.shutdown`; README.md, "Supervision").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from rlt_contracts import ModelInfo
from rlt_contracts.pd import PDRole
from rlt_models.model_source import resolve_tokenizer_dir
from rlt_serve import is_loopback
from rlt_serve.front_options import FrontOptions, build_front_app
from rlt_serve.listening import listening_socket
from rlt_serve.server_drain import ServerDrain
from rlt_serve.shutdown import (
    StopRequested,
    StopSignals,
    signal_name,
    stopping,
)

from rlt_pd_coordinator.client import PDEngineClient
from rlt_pd_coordinator.cluster import Cluster, ClusterOptions
from rlt_pd_coordinator.model_files import build_model_info, load_tokenizer, resolve_model
from rlt_pd_coordinator.options import CoordinatorOptions
from rlt_pd_coordinator.supervisor import Supervisor, SupervisorOptions

logger = logging.getLogger("rlt_pd_coordinator")

HARD_STOP_MARGIN_S = 5.0
INSTANCES_PATH = "/v1/pd/instances"


def _in_daemon_thread(function, *args) -> asyncio.Future:
    """`function(*args)` on a daemon thread, as a future of the running loop. Not on the
    loop's executor: `asyncio.run` joins that one's threads on the way out, so a stop during
    start-up would wait for the tokenizer's first import of torch and transformers (15 s on a
    busy 2-core machine); a daemon thread is left behind instead."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():  # cancelled: its waiter left
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result = error = None
        try:
            result = function(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="rlt-pd-tokenizer", daemon=True).start()
    return future


def build_front(client: PDEngineClient, tokenizer: Any, options: FrontOptions):
    """The coordinator's HTTP front over `client`: rlt-serve's app (the OpenAI routes, health
    from `client.unavailable`) plus `GET /v1/pd/instances`. `options`: the front's (with
    `front`, vLLM's --seed and --chat-template: `CoordinatorOptions` or rlt-ray's
    `ServeOptions`; rlt-ray's PD ingress hosts the same front in a Ray Serve deployment)."""
    app = build_front_app(
        client, tokenizer, options, options.front, engine_error=client.unavailable
    )

    async def instances_view() -> JSONResponse:
        return JSONResponse(
            {"mode": client.mode, "instances": [i.snapshot() for i in client.cluster.instances]}
        )

    app.add_api_route(
        INSTANCES_PATH,
        instances_view,
        methods=["GET"],
        tags=["pd"],
        summary="The coordinator's engine instances: role, state, load, credits",
    )
    return app


class Coordinator:
    """One coordinator: cluster, supervisor, client and app (see the module docstring).

    tokenizer: use this tokenizer instead of loading the model directory's (tests).
    model_info: use this instead of reading the model directory's config (tests).
    """

    def __init__(
        self,
        options: CoordinatorOptions,
        *,
        tokenizer: Any = None,
        model_info: ModelInfo | None = None,
    ) -> None:
        options.check()
        self.options = options
        self._tokenizer = tokenizer
        self._model_info = model_info
        self.cluster = Cluster(
            options.instances(),
            ClusterOptions(
                mode=options.mode,
                api_key=options.instance_api_key,
                connect_timeout=options.connect_timeout,
                poll_interval=options.coordination.poll_interval,
                credit_wait=options.coordination.credit_wait,
            ),
        )
        self.supervisor: Supervisor | None = None
        self.client: PDEngineClient | None = None
        self.app = None
        self.server: uvicorn.Server | None = None
        self._closed = False

    async def start(self) -> None:
        options = self.options
        model_dir = tokenizer_path = None
        model_name = options.served_model_name
        if self._model_info is None or self._tokenizer is None or self._has_children():
            source = resolve_model(
                options.model,
                revision=options.revision,
                download_dir=options.download_dir,
                tokenizer=options.tokenizer is None,
            )
            model_dir, model_name = source.local_dir, model_name or source.name
            tokenizer_path = (
                resolve_tokenizer_dir(options.tokenizer, download_dir=options.download_dir)
                or model_dir
            )
        if self._has_children():
            # the instances detokenize with the front's tokenizer: --tokenizer's directory
            separate = () if options.tokenizer is None else ("--tokenizer", str(tokenizer_path))
            self.supervisor = Supervisor(
                self.cluster,
                SupervisorOptions(
                    model=str(model_dir),
                    command=options.command,
                    engine_args=(*options.engine_args, *separate),
                    devices=options.devices,
                    api_key=options.instance_api_key,
                    log_level=options.instance_log_level,
                    startup_timeout=options.startup_timeout,
                    stop_timeout=options.stop_timeout,
                    restart_delay=options.restart_delay,
                ),
            )
        tokenizer = self._tokenizer
        loading = None
        if tokenizer is None:  # load it while the instances start
            loading = _in_daemon_thread(load_tokenizer, tokenizer_path)
        try:
            if self.supervisor is not None:
                await self.supervisor.start()
            await self.cluster.admit_all()
            if loading is not None:
                tokenizer = await loading
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
        info = self._model_info or build_model_info(model_dir, model_name, self.cluster.instances)
        if self.supervisor is not None:
            self.supervisor.watch()
        self.cluster.start_polling()
        self.client = PDEngineClient(self.cluster, info, timeouts=options.coordination.timeouts)
        self.app = build_front(self.client, tokenizer, options)
        counts = {r: len(self.cluster.of_role(r)) for r in PDRole}
        logger.info(
            "coordinator ready (%s mode: %d prefill, %d decode, %d replicas)",
            options.mode,
            counts[PDRole.PREFILL],
            counts[PDRole.DECODE],
            counts[PDRole.NONE],
        )

    def _has_children(self) -> bool:
        return any(i.local for i in self.cluster.instances)

    async def serve(
        self, sockets: list[socket.socket] | None = None, signals: StopSignals | None = None
    ) -> None:
        """Run the front until uvicorn is told to exit (`server.should_exit`, or the signals
        counted by `signals`, the process's installed policy; None: none are handled)."""
        options = self.options
        signals = signals or StopSignals()  # not installed: only `should_exit` stops it
        config = uvicorn.Config(
            self.app,
            host=options.host,
            port=options.port,
            lifespan="on",
            timeout_graceful_shutdown=options.shutdown_timeout + HARD_STOP_MARGIN_S,
            server_header=False,
            **options.front.uvicorn_options(options.log_level),  # TLS, uvicorn's logs
        )
        self.server = _DrainingServer(
            config,
            self.client,
            signals=signals,
            grace_s=options.shutdown_timeout,
            on_shutdown=self.supervisor.stop_watching if self.supervisor else None,
        )
        with signals.acting(self.server.drain.act):
            if signals.stage:  # a stop signal since the start-up ended: stop after starting
                self.server.should_exit = True
            await self.server.serve(sockets=sockets)

    async def close(self) -> None:
        """Abort what is in flight, stop the children, close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.supervisor is not None:
            self.supervisor.stop_watching()
        if self.client is not None:
            await self.client.shutdown()
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.cluster.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with the serving phase of the stop-signal policy (`ServerDrain`, as
    `rlt serve`): the first signal drains, `grace_s` seconds into it (or at a second signal)
    the requests still in flight are aborted, so that they end with finish_reason "abort"
    instead of having their connections cut."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: PDEngineClient,
        *,
        signals: StopSignals,
        grace_s: float,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = ServerDrain(self, signals, grace_s=grace_s, abort=client.shutdown)
        self._on_shutdown = on_shutdown

    def capture_signals(self):
        return self.drain.capture_signals()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # the URL once it answers (the port the OS chose for --port 0)
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            scheme = "https" if self.config.is_ssl else "http"
            logger.info("ready at %s://%s:%d", scheme, self.config.host, port)

    async def shutdown(self, sockets=None) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
        async with self.drain.grace_period():
            await super().shutdown(sockets)


# -- the process ------------------------------------------------------------------------------
def run(options: CoordinatorOptions) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit code (`rlt_serve.shutdown`: 0 after a
    stop by signal, 128 + the second signal's number when it cut the drain short)."""
    if options.api_key is None and not is_loopback(options.host):
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", options.host
        )
    signals = StopSignals().install()  # until the process exits (rlt_serve.shutdown)
    try:
        return asyncio.run(_run(options, signals))
    except StopRequested:  # before the event loop ran
        return signals.exit_code()
    finally:
        signals.finish()


async def _run(options: CoordinatorOptions, signals: StopSignals) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def stop_starting(signum: int, stage: int) -> None:
        if stage == 1:
            logger.info("%s during startup: stopping", signal_name(signum))
        loop.call_soon_threadsafe(stop.set)

    with signals.acting(stop_starting):
        coordinator = Coordinator(options)
        # before any child: a taken port fails at once
        sock = listening_socket(options.host, options.port)
        try:
            if await _start(coordinator, stop, signals):
                await coordinator.serve(sockets=[sock], signals=signals)
                logger.info("front stopped; stopping the instances")
            return signals.exit_code()
        finally:
            supervisor = coordinator.supervisor
            kill = supervisor.kill_all if supervisor is not None else lambda: None
            with signals.acting(stopping(kill, "the engine instances")):
                await coordinator.close()
            sock.close()


async def _start(coordinator: Coordinator, stop: asyncio.Event, signals: StopSignals) -> bool:
    """Start the coordinator unless a stop signal comes first (then False)."""
    starting = asyncio.create_task(coordinator.start())
    stopping_task = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping_task}, return_when=asyncio.FIRST_COMPLETED)
    stopping_task.cancel()
    if starting.done() and not signals.stage:
        starting.result()
        return True
    logger.info("stopped during startup")
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return False
