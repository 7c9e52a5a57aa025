"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

Every failure a request can cause maps to one `APIError` here, so handlers raise and never
build error bodies themselves; the statuses, types and codes: docs/serving.md, "Errors"
(pydantic's validation errors: validation_errors.py).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from rlt_contracts import (
    CapacityError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RltError,
)


class APIError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message, param = printable(message), printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def printable(text: str | None) -> str | None:
    """`text` with lone UTF-16 surrogates escaped ("\\ud800"): such strings come from JSON
    escapes in a request, and the error body that quotes them must still encode as UTF-8."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(param: str | None, message: str, *, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def from_engine_error(exc: BaseException, *, field_names: dict[str, str] | None = None) -> APIError:
    """Map an `EngineClient` error to its HTTP answer; `field_names` renames engine fields to
    this endpoint's request fields (e.g. chat's "logprobs" is "top_logprobs")."""
    if isinstance(exc, InvalidRequestError):
        param = (field_names or {}).get(exc.field, exc.field)
        code = CONTEXT_LENGTH_EXCEEDED if isinstance(exc, CapacityError) else None
        return APIError(400, f"{param}: {exc.message}", param=param, code=code)
    if isinstance(exc, OverloadedError):
        return APIError(
            429,
            f"the server is overloaded: {exc}",
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            503,
            f"the engine is unavailable: {exc}",
            type="service_unavailable",
            code="engine_unavailable",
        )
    if isinstance(exc, RltError):
        return APIError(500, f"engine error: {exc}", type="internal_error")
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")


async def handle_api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def handle_http_exception(_request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method) in the same body shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    kind = "invalid_request_error" if status < 500 else "internal_error"
    headers = getattr(exc, "headers", None)
    return APIError(status, str(detail), type=kind, headers=headers).response()


async def handle_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    return from_engine_error(exc).response()


def sse_error_event(error: APIError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode()
