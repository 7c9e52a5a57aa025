"""`FrontOptions`: the options of an OpenAI-compatible front (`rlt serve`'s, and `rlt ray`'s
ingress: `ServeOptions`; the PD coordinator's: its `CoordinatorOptions`), each field one flag
with its help (rlt_contracts.options, rlt_serve.option_flags), with the loop defaults of
requests nested (`LoopDefaults`). Importing it imports no torch (the commands build their
parsers with it before torch loads)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from rlt_contracts import ConfigurationError, Option
from rlt_contracts.options import check_option_values

from rlt_serve.app import DEFAULT_MAX_BODY_BYTES, build_app
from rlt_serve.guards import LOOPBACK_HOSTS, is_loopback
from rlt_serve.listening import port_number
from rlt_serve.params import LoopDefaults
from rlt_serve.vllm_flags import FrontSettings

LOG_LEVELS = Literal["critical", "error", "warning", "info", "debug"]


class FrontOptions(msgspec.Struct, frozen=True, kw_only=True):
    """server"""

    host: Annotated[
        str, Option("address to bind (default: loopback only; 0.0.0.0 for every interface)")
    ] = "127.0.0.1"
    port: Annotated[int, Option("port to listen on, 0..65535 (0: any free)", parse=port_number)] = (
        8000
    )
    api_key: Annotated[
        str | None,
        Option(
            "require 'Authorization: Bearer KEY' on /v1/* (default: $RLT_API_KEY)",
            env="RLT_API_KEY",
        ),
    ] = None
    served_model_name: Annotated[
        str | None,
        Option(
            "model name in the API (default: the Hugging Face model id as given, else the "
            "model directory's name)"
        ),
    ] = None
    max_body_bytes: Annotated[int, Option("larger request bodies are refused (HTTP 413)")] = (
        DEFAULT_MAX_BODY_BYTES
    )
    allowed_origins: Annotated[
        tuple[str, ...],
        Option(
            "browser origin allowed to call the API (CORS; repeatable); requests from other "
            "origins are refused",
            flags=("--allowed-origin",),
        ),
    ] = ()
    shutdown_timeout: Annotated[
        float,
        Option(
            "seconds in-flight requests may take to finish after SIGINT/SIGTERM before they "
            "are aborted"
        ),
    ] = 10.0
    log_level: Annotated[
        LOG_LEVELS,
        Option("level of the server's log lines (rlt's, and uvicorn's unless --uvicorn-log-level)"),
    ] = "info"
    loop_defaults: LoopDefaults = msgspec.field(default_factory=LoopDefaults)

    def __post_init__(self) -> None:
        check_option_values(self)
        if self.max_body_bytes < 1:
            raise ConfigurationError("max_body_bytes", f"must be >= 1, got {self.max_body_bytes}")
        if self.api_key == "":  # an empty $RLT_API_KEY: no key
            msgspec.structs.force_setattr(self, "api_key", None)


class ServeOptions(FrontOptions, frozen=True, kw_only=True):
    """server"""

    api_server_count: Annotated[
        int,
        Option(
            "front-end processes (HTTP, tokenization, detokenization) sharing the port over "
            "the one engine-core process"
        ),
    ] = 1
    # vLLM's front flags: --seed, --chat-template, TLS, --uvicorn-log-level,
    # --disable-log-requests (rlt_serve.vllm_flags)
    front: FrontSettings = msgspec.field(default_factory=FrontSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_server_count < 1:
            raise ConfigurationError(
                "api_server_count", f"must be >= 1, got {self.api_server_count}"
            )


def build_front_app(client, tokenizer, options: FrontOptions, front: FrontSettings, **extra):
    """rlt-serve's app (`rlt_serve.build_app`) over `client` with a front's options: `rlt
    serve`'s front ends and rlt-ray's ingress (`ServeOptions`), the PD coordinator's front
    (`CoordinatorOptions`); `front`: vLLM's --seed and --chat-template; `extra`: build_app's
    `engine_error`, `pd`, `version`."""
    return build_app(
        client,
        served_model_name=options.served_model_name or client.model_info().name,
        tokenizer=tokenizer,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        loop_defaults=options.loop_defaults,
        allowed_hosts=LOOPBACK_HOSTS if is_loopback(options.host) else None,
        allowed_origins=options.allowed_origins,
        chat_template=front.chat_template,
        default_seed=front.default_seed,
        **extra,
    )
