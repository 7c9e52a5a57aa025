"""`rlt serve`: the engine core in its own process, front ends with the rlt-serve app in uvicorn.

    rlt serve (front end: HTTP, tokenization, output processing)  --ZeroMQ-->  engine core process
    rlt serve --api-server-count N: a supervisor, N front-end processes sharing one listening
    socket, one engine core process (rlt.serving.supervisor)

`build_server(engine)` instead runs the core on a thread of this process (tests, embedders);
both use the same `CoreClient`, `CoreLoop` and messages. A front end (the app, uvicorn,
`DrainingServer`) is `rlt.serving.front_end`'s, shared with the supervisor.

Shutdown follows `rlt_serve.shutdown` (one policy for every rlt server; docs/serving.md,
"Shutdown", gives the answers and exit codes): `rlt serve` installs a `StopSignals` before the
core starts, so a stop signal during start-up kills the core (nothing runs yet) and exits 0;
while serving, `DrainingServer` routes the signals to a `ServerDrain`, and a handler that still
hangs is cancelled `HARD_STOP_MARGIN_S` after the grace period. If the core process dies the
server exits with `EXIT_ENGINE_DIED` once the in-flight answers went out; if the front end
dies, the core sees its parent's pipe close and exits too.
"""

from __future__ import annotations

import logging

from rlt_contracts import ConfigurationError
from rlt_serve import is_loopback
from rlt_serve.front_options import ServeOptions
from rlt_serve.shutdown import StopRequested, StopSignals, stopping

from rlt.engine.config import EngineConfig
from rlt.engine.llm_engine import LLMEngine
from rlt.engine.startup import StartupClock, configure_logging
from rlt.serving.async_engine import AsyncEngine
from rlt.serving.core_process_client import CoreProcess
from rlt.serving.front_end import (
    build_front_app,
    front_end_tokenizer,
    run_front_end,
    tokenizer_source,
)

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
