"""Messages between front ends and the engine core (0.1.11).

The core runs a busy loop (schedule -> execute -> update) in its own process (or, for the
offline API and tests, on its own thread) and talks with its front ends only through these
msgspec structs: `CoreInput` in, `CoreOutputs` out. A front end owns HTTP, tokenization,
detokenization, stop strings and streaming; the core owns request progression and the device.

    front end                                   core
    ---------                                   ----
    CoreAdd(call_id, requests)  ------------>   validate, queue (all or none)
                                <------------   CoreOutputs(replies=(CoreReply(call_id),))
    CoreAbort(ids, reason)      ------------>   abort (client gone) or finish (stop string)
    CorePDConnect(call_id, ...) ------------>   the PD transport connects peers
                                <------------   CoreOutputs(deltas, stats): once per step
                                                for the requests that progressed

Every `CoreOutputs` carries the statistics of the moment it was made, so a front end that has
seen a delta never reads older statistics. A failed call comes back as a `WireError`, which
`raise_wire_error` turns into the typed `RltError` the core raised.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlt_contracts import errors
from rlt_contracts.outputs import EngineRequest, EngineStats, ModelInfo, RequestOutputDelta
from rlt_contracts.pd import PDCompatibility, PDRole
from rlt_contracts.requests import FinishReason


class CoreAdd(msgspec.Struct, frozen=True, tag="add"):
    """Queue these requests, all or none; answered by `CoreReply(call_id)`."""

    call_id: int
    requests: tuple[EngineRequest, ...]


class CoreAbort(msgspec.Struct, frozen=True, tag="abort"):
    """End these requests: ABORT (the client went away) or STOP (the front end matched a stop
    string). Each one still gets its final delta; unknown or finished ids are ignored."""

    request_ids: tuple[str, ...]
    finish_reason: FinishReason = FinishReason.ABORT


class CorePDConnect(msgspec.Struct, frozen=True, tag="pd_connect"):
    """Connect the PD transport to these peers (their handshake metadata); the reply's
    `result` is [connected agents, incompatibility messages, other failures]."""

    call_id: int
    peers: tuple[bytes, ...]


class CoreClientGone(msgspec.Struct, frozen=True, tag="client_gone"):
    """Sent by the supervisor: front end `client` died; abort its requests, free their KV."""

    client: str


class CoreShutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Abort everything, send the final deltas and stop."""


CoreInput = CoreAdd | CoreAbort | CorePDConnect | CoreClientGone | CoreShutdown


class WireError(msgspec.Struct, frozen=True):
    """A typed error across the boundary: the `RltError` subclass name and its fields. A
    subclass from another package that extends one of the contracts' errors (rlt-models'
    `ModelConfigError` is a `ConfigurationError`) crosses as that contracts class, so the
    receiver rebuilds its type and its fields (the offending option or file)."""

    kind: str
    message: str
    field: str = ""

    @classmethod
    def of(cls, error: BaseException) -> WireError:
        kind = _contract_kind(error) if isinstance(error, errors.RltError) else "RltError"
        if isinstance(error, errors.InvalidRequestError):
            return cls(kind, error.message, error.field)
        if isinstance(error, errors.ConfigurationError):
            return cls(kind, error.message, " + ".join(error.options))
        return cls(kind, str(error) if isinstance(error, errors.RltError) else repr(error))


def _contract_kind(error: errors.RltError) -> str:
    """The error's class name if rlt-contracts defines it, else that of the nearest
    contracts class it extends; a direct `RltError` subclass keeps its own name (it arrives as
    `RltError` with that name in the message)."""
    for klass in type(error).__mro__:
        if getattr(errors, klass.__name__, None) is klass:
            return klass.__name__ if klass is not errors.RltError else type(error).__name__
    return type(error).__name__


def raise_wire_error(error: WireError) -> None:
    """Raise the error the core raised: its `RltError` class when it is one of the contracts'
    (other classes arrive as `RltError` with the class name in the message)."""
    cls = getattr(errors, error.kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.InvalidRequestError):
        raise cls(error.field, error.message)
    if isinstance(cls, type) and issubclass(cls, errors.ConfigurationError):
        raise cls(tuple(error.field.split(" + ")), error.message)
    if isinstance(cls, type) and issubclass(cls, errors.RltError) and cls is not errors.RltError:
        raise cls(error.message)
    raise errors.RltError(f"{error.kind}: {error.message}")


class CoreReply(msgspec.Struct, frozen=True):
    """The answer to a call (`CoreAdd`, `CorePDConnect`): `error` None means it succeeded."""

    call_id: int
    error: WireError | None = None
    result: Any = None


class CoreOutputs(msgspec.Struct, frozen=True):
    """One round of the core for one front end: the deltas of its requests that progressed
    (in order), the replies to its calls, and the statistics after the round."""

    deltas: tuple[RequestOutputDelta, ...] = ()
    replies: tuple[CoreReply, ...] = ()
    stats: EngineStats | None = None


class PDStaticInfo(msgspec.Struct, frozen=True):
    """What a PD instance's front end needs once: role, agent, handshake metadata."""

    role: PDRole
    agent: str
    metadata: bytes
    compatibility: PDCompatibility


class CoreReady(msgspec.Struct, frozen=True):
    """The core's first message to whoever started it: it is built and serving."""

    model_info: ModelInfo
    stats: EngineStats
    pd: PDStaticInfo | None = None
