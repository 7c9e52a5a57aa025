"""Reject request strings that are not valid Unicode.

JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python decodes it into a `str` that cannot
be encoded as UTF-8, so a tokenizer (or anything writing it out) fails on it. Every string of
a request body, dictionary keys included, is checked before it is used, and the first one
holding a lone surrogate answers 400 naming its field (`prompt[1]`, `messages[0].content`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rlt_serve.errors import invalid


def check_valid_unicode(body: BaseModel) -> None:
    """400 naming the first field of `body` whose text holds a lone UTF-16 surrogate."""
    param = first_invalid_text(body)
    if param is not None:
        raise invalid(
            param or None,
            f"{param or 'the body'}: the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
            "escape without its pair), which is not valid Unicode",
        )


def first_invalid_text(value: Any) -> str | None:
    """The path of the first string (or dictionary key) in `value` (a model, or parsed JSON)
    that holds a lone surrogate: "" for `value` itself, None when there is none."""
    return _first_invalid(value, "")


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first_invalid(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if has_lone_surrogate(value) else None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found = _first_invalid(getattr(value, name), _join(path, name))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_invalid(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            key_path = _join(path, str(key))
            if isinstance(key, str) and has_lone_surrogate(key):
                return key_path
            found = _first_invalid(item, key_path)
            if found is not None:
                return found
    return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
