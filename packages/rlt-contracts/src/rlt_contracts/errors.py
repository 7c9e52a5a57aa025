"""Typed errors that cross package boundaries.

Every error a caller can trigger with bad input derives from `RltError` and from the matching
builtin (`ValueError`), so `except ValueError` keeps working for users who do not know our types.
"""

from __future__ import annotations


class RltError(Exception):
    """Base class of every error rlt raises on purpose."""


class InvalidRequestError(RltError, ValueError):
    """A request (prompt, sampling parameters, id) is invalid; the engine keeps serving.

    `field` names the offending request field (e.g. "top_p", "prompt"), so HTTP frontends can
    report it in their error body.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigurationError(RltError, ValueError):
    """An engine option, or a combination of options, is invalid.

    `options` lists every option involved, so a message about a bad combination names both.
    """

    def __init__(self, options: tuple[str, ...] | str, message: str) -> None:
        names = (options,) if isinstance(options, str) else tuple(options)
        super().__init__(f"{' + '.join(names)}: {message}")
        self.options = names
        self.message = message


class CapacityError(InvalidRequestError):
    """A request can never fit (context length or KV pool too small), whatever else runs."""


class EngineDeadError(RltError, RuntimeError):
    """The engine loop failed or was shut down; no further requests are accepted."""


class OverloadedError(RltError, RuntimeError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""
