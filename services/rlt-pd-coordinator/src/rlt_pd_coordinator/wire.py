"""The engine instances' internal PD endpoints, as the coordinator uses them.

The protocol and its structs are `rlt_contracts.pd_wire`'s (the engine side imports the same;
its module doc lists the endpoints and the stream lines of each role). As the coordinator reads
them: a generate call may also answer a 5xx error body before its stream starts, and a prefill
stream may carry {"progress": {...}} lines before its {"done": ...}. Closing the HTTP
connection aborts the request on that engine.

This module adds what only the coordinator needs: the instances' /health and /v1/models, the
OpenAI error body, decoders, and the mapping of an instance's error answer to the
`rlt_contracts` error the front answers with.
"""

from __future__ import annotations

import msgspec
from rlt_contracts import (
    CapacityError,
    ConfigurationError,
    InvalidRequestError,
    OverloadedError,
    RltError,
)
from rlt_contracts.pd_wire import (
    CONNECT_PATH,
    GENERATE_PATH,
    INFO_PATH,
    NDJSON,
    ConnectBody,
    ConnectReply,
    GenerateBody,
    InstanceInfo,
    InstanceLoad,
    StreamError,
    StreamLine,
)

HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"

__all__ = [
    "CONNECT_PATH",
    "GENERATE_PATH",
    "HEALTH_PATH",
    "INFO_PATH",
    "MODELS_PATH",
    "NDJSON",
    "ConnectBody",
    "ConnectReply",
    "ErrorBody",
    "ErrorDetail",
    "GenerateBody",
    "InstanceError",
    "InstanceInfo",
    "InstanceLoad",
    "InstanceUnavailableError",
    "ModelCard",
    "ModelList",
    "StreamError",
    "StreamLine",
    "encode",
    "error_from_response",
    "info_decoder",
    "line_decoder",
    "models_decoder",
]


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, frozen=True):
    """The OpenAI-style error body every rlt server answers with."""

    error: ErrorDetail


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    max_model_len: int
    num_loops: int


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]


line_decoder = msgspec.json.Decoder(StreamLine)
info_decoder = msgspec.json.Decoder(InstanceInfo)
models_decoder = msgspec.json.Decoder(ModelList)
encode = msgspec.json.Encoder().encode


class InstanceError(RltError):
    """An engine instance failed, broke its stream, or answered something unexpected.

    rlt-serve answers it like any engine error (HTTP 500, or an in-band stream error)."""


class InstanceUnavailableError(InstanceError):
    """The instance could not be reached, or said it is dead or shutting down (503): nothing
    was started there, so the request may go to another instance."""


def error_detail(content: bytes) -> ErrorDetail:
    """The error body's detail, or the body's text as the message when it is not one."""
    try:
        return msgspec.json.decode(content, type=ErrorBody).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = content.decode("utf-8", "replace").strip()
        return ErrorDetail(message=text[:500] or "(empty body)")


def error_from_response(status: int, content: bytes, where: str) -> RltError:
    """Map an instance's non-200 answer to the `rlt_contracts` error rlt-serve answers with.

    Request errors (400, 413, 422: the engine's validation) keep their field and message, so
    the client sees exactly what a single engine would have said.
    """
    detail = error_detail(content)
    message = detail.message or f"HTTP {status}"
    if status in (400, 413, 422):
        field = detail.param or "request"
        prefix = f"{field}: "
        text = message[len(prefix) :] if message.startswith(prefix) else message
        if detail.code == "context_length_exceeded":
            return CapacityError(field, text)
        return InvalidRequestError(field, text)
    if status == 409 and detail.code == "pd_incompatible":
        return ConfigurationError("compatibility", f"{where} refused to connect: {message}")
    if status == 429:
        return OverloadedError(f"{where}: {message}")
    if status == 503:
        return InstanceUnavailableError(f"{where} is unavailable: {message}")
    if status in (401, 403):
        return InstanceError(
            f"{where} refused the coordinator's credentials (HTTP {status}: {message}); "
            "check --instance-api-key"
        )
    return InstanceError(f"{where} answered HTTP {status}: {message}")
