"""`ServeOptions`: the HTTP-side options of `rlt serve` (importing them imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_serve import DEFAULT_MAX_BODY_BYTES, LoopDefaults
from rlt_serve.vllm_flags import FrontSettings

EXIT_ENGINE_DIED = 1  # exit code of `rlt serve` when the engine core died under the server


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
    api_server_count: int = 1  # front-end processes over the one engine core
    # vLLM's front flags: --seed, --chat-template, TLS, --uvicorn-log-level,
    # --disable-log-requests (rlt_serve.vllm_flags)
    front: FrontSettings = field(default_factory=FrontSettings)
