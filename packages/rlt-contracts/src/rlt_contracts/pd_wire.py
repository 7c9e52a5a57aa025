"""The internal PD endpoints of an engine instance, as the coordinator and the instance speak
them over HTTP (JSON bodies, NDJSON streams). Both sides import these structs from here.

Every engine instance (`rlt serve MODEL --pd-role prefill|decode|none`) serves, next to the
OpenAI API and behind the same API key and Host guards:

  GET  /internal/pd/info      -> InstanceInfo (role, transport agent and metadata,
                                 compatibility, load)
  POST /internal/pd/connect   ConnectBody -> ConnectReply, or 409 (code "pd_incompatible")
                                 whose message names every mismatching field
  POST /internal/pd/generate  GenerateBody -> NDJSON stream of StreamLine objects
                                 (application/x-ndjson), or a 4xx error body before it starts

Stream lines by role:
  decode:  {"target": HandoffTarget} once D admitted the request and reserved its KV, then
           {"delta": RequestOutputDelta} lines until one with finished=true.
  prefill: {"done": {"transfer_id": ...}} when P's writes completed, or
           {"error": {"message": ..., "code": ...}}.
  none:    {"delta": ...} lines only (a whole engine; the plain router).
Closing the HTTP connection aborts the request on that instance.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from rlt_contracts.errors import RltError
from rlt_contracts.outputs import EngineRequest, RequestOutputDelta
from rlt_contracts.pd import HandoffTarget, KVTransferParams, PDCompatibility, PDRole

INFO_PATH = "/internal/pd/info"
CONNECT_PATH = "/internal/pd/connect"
GENERATE_PATH = "/internal/pd/generate"
NDJSON = "application/x-ndjson"

__all__ = [
    "CONNECT_PATH",
    "GENERATE_PATH",
    "INFO_PATH",
    "NDJSON",
    "ConnectBody",
    "ConnectReply",
    "GenerateBody",
    "InstanceInfo",
    "InstanceLoad",
    "PDControl",
    "PDIncompatibleError",
    "StreamError",
    "StreamLine",
]


class PDIncompatibleError(RltError, ValueError):
    """A peer cannot exchange KV with this instance; the message names every differing field
    (HTTP 409, code "pd_incompatible")."""


class InstanceLoad(msgspec.Struct, frozen=True):
    """An instance's load gauges at the time of its info answer."""

    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0


class InstanceInfo(msgspec.Struct, frozen=True):
    """`GET /internal/pd/info`. `metadata` is the base64 of the opaque transport metadata that
    peers pass to `connect`; a restarted instance has a new agent and new metadata."""

    role: PDRole
    agent: str = ""
    metadata: str = ""
    compatibility: PDCompatibility | None = None
    load: InstanceLoad = msgspec.field(default_factory=InstanceLoad)


class ConnectBody(msgspec.Struct, frozen=True):
    """`POST /internal/pd/connect`: the peers' base64 transport metadata."""

    peers: list[str]


class ConnectReply(msgspec.Struct, frozen=True):
    """The agent names now connected."""

    connected: list[str] = msgspec.field(default_factory=list)


class GenerateBody(msgspec.Struct, frozen=True):
    """`POST /internal/pd/generate`: the request and its role in the handoff."""

    request: EngineRequest
    kv_transfer_params: KVTransferParams


class StreamError(msgspec.Struct, frozen=True):
    message: str = "unknown error"
    code: str | None = None


class StreamLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """One NDJSON line of a generate stream; exactly one field is set."""

    target: HandoffTarget | None = None
    delta: RequestOutputDelta | None = None
    progress: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    error: StreamError | None = None


class PDControl(Protocol):
    """What an engine instance offers the PD endpoints besides its `EngineClient`.

    role: this instance's role. info(): a cheap snapshot (agent, metadata, load).
    connect(peers): load each peer's transport metadata (raw bytes) and open the connection;
      returns the peers' agent names; raises PDIncompatibleError naming every mismatching
      field (nothing of that peer is kept).
    """

    @property
    def role(self) -> PDRole: ...

    def info(self) -> InstanceInfo: ...

    async def connect(self, peers: list[bytes]) -> list[str]: ...
