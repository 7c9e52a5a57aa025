"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

Every failure a request can cause maps to one `APIError` here, so handlers raise and never
build error bodies themselves:

  400 invalid_request_error  malformed JSON, wrong types, unknown fields, invalid values
                             (`param` names the field)
  401 authentication_error   missing or wrong API key            (code invalid_api_key)
  403 permission_error       cross-origin browser request or foreign Host header
  404 invalid_request_error  unknown model                       (code model_not_found)
  413 invalid_request_error  body larger than --max-body-bytes   (code request_too_large)
  415 invalid_request_error  body is not JSON
  429 rate_limit_error       the engine's waiting queue is full  (code overloaded; Retry-After)
  500 internal_error         a bug, or the engine failed on this request
  503 service_unavailable    the engine is dead or shutting down (code engine_unavailable)
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from rlt_contracts import (
    CapacityError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RltError,
)

# pydantic names union members in error locations ("prompt" -> "list[int]" -> 0); those
# segments are not request fields.
_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "none",
    "list",
    "dict",
    "function-after",
    "function-before",
    "function-wrap",
    "literal",
    "tagged-union",
}


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


def param_of(location: tuple[Any, ...]) -> str | None:
    """'messages[0].content' from a pydantic error location ('body', 'messages', 0, 'content')."""
    parts = list(location[1:] if location and location[0] == "body" else location)
    name = ""
    for part in parts:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and not _is_tag(part):
            name += f".{part}" if name else part
        else:
            break  # a union member tag: the field itself is named already
    return name or None


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid(None, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return invalid(None, f"malformed JSON body: {detail}".rstrip(": "))
    if kind == "string_unicode":  # pydantic cannot even read a key holding a lone surrogate
        from rlt_serve.unicode_input import first_invalid_text

        param = first_invalid_text(getattr(exc, "body", None))
        return invalid(
            param or None,
            f"{param or 'the body'}: the text holds a lone UTF-16 surrogate, which is not "
            "valid Unicode",
        )
    location = tuple(first.get("loc", ()))
    param = param_of(location)
    if kind == "extra_forbidden":  # the last segment is the unknown name itself, whatever it is
        parent, name = param_of(location[:-1]), str(location[-1])
        param = f"{parent}.{name}" if parent else name
        return invalid(param, f"Unrecognized request argument supplied: {param}")
    if param is None:
        return invalid(None, "the request body must be a JSON object")
    if kind == "missing":
        return invalid(param, f"{param}: field required")
    members = _union_members(errors, location)
    if len(members) > 1:  # pydantic reports one error per union member
        return invalid(param, f"{param}: must be one of {', '.join(members)}")
    return invalid(param, f"{param}: {first.get('msg', 'invalid value')}")


def _union_members(errors: list[dict[str, Any]], location: tuple[Any, ...]) -> list[str]:
    """The member tags of the union at the first error's field, e.g. ['str', 'list[int]']."""
    depth = next(
        (i for i, part in enumerate(location) if isinstance(part, str) and _is_tag(part)), None
    )
    if depth is None:
        return []
    members: list[str] = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if loc[:depth] == location[:depth] and len(loc) > depth and loc[depth] not in members:
            members.append(str(loc[depth]))
    return members


def _is_tag(part: str) -> bool:
    return not part.isidentifier() or part in _TYPE_TAGS


async def handle_api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def handle_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_to_api_error(exc).response()


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
