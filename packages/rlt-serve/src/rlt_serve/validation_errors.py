"""Request validation errors (pydantic's, as FastAPI raises them) to OpenAI error bodies: a 400
whose `param` names the field in the request's own terms (`messages[0].content`, not pydantic's
location `('body', 'messages', 0, 'content')`), one message per field however many union
members pydantic tried.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlt_serve.errors import APIError, invalid
from rlt_serve.unicode_input import first_invalid_text

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


async def handle_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_to_api_error(exc).response()
