"""Wire formats of the KV handoff: control messages, transport metadata and the typed errors.

Pure (msgspec only, no torch). Every notification between P's and D's transports is one
msgpack-encoded `ControlMessage`, a tagged union (field "kind"): `landed` and `commit` (P -> D),
`cancel` (D -> P), `drained` (P -> D); README.md, "Control messages", says what each vouches
for. A notification that does not decode, or a kind the receiving role never gets, is a
protocol violation (`HandoffProtocolError`); an unknown or stale transfer id is not (it is
dropped).
"""

from __future__ import annotations

import msgspec
from rlt_contracts import RltError
from rlt_contracts.pd import PDCompatibility

from rlt_pd.receive import HandoffProtocolError
from rlt_pd.region import KVRegion

PROTOCOL_VERSION = 1

__all__ = [
    "PROTOCOL_VERSION",
    "Cancel",
    "Commit",
    "ControlMessage",
    "Drained",
    "Landed",
    "PDCompatibilityError",
    "PDTransportError",
    "TransportMetadata",
    "check_compatibility",
    "decode_message",
    "encode_message",
]


class PDCompatibilityError(RltError, ValueError):
    """P and D cannot exchange KV: the message names every mismatching field (refused at
    connect)."""


class PDTransportError(RltError, RuntimeError):
    """The transport cannot do what was asked (closed, unknown peer, NIXL refused)."""


class Landed(msgspec.Struct, frozen=True, tag_field="kind", tag="landed"):
    transfer_id: str
    sequence: int


class Commit(msgspec.Struct, frozen=True, tag_field="kind", tag="commit"):
    transfer_id: str
    count: int


class Cancel(msgspec.Struct, frozen=True, tag_field="kind", tag="cancel"):
    transfer_id: str


class Drained(msgspec.Struct, frozen=True, tag_field="kind", tag="drained"):
    transfer_id: str


ControlMessage = Landed | Commit | Cancel | Drained

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode_message(message: ControlMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(data: bytes) -> ControlMessage:
    """Raises HandoffProtocolError for bytes that are no control message."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise HandoffProtocolError(
            f"undecodable handoff notification {data[:64]!r}: {error}"
        ) from error


class TransportMetadata(msgspec.Struct, frozen=True):
    """What one engine's transport publishes for the handshake (`KVTransport.metadata()`).

    agent_metadata: NIXL's agent metadata (connection info and registered memory).
    memory: "DRAM" or "VRAM"; device_id: the CUDA device (0 for DRAM).
    key_address / value_address / hidden_address: base addresses of the registered tensors.
    region: K/V byte geometry; `region.num_blocks` excludes the scratch block(s), so plans never
        target them. allocated_blocks: size of the tensors' block axis (scratch included).
    hidden_rows / hidden_row_stride_bytes: the rows' hidden-state tensor [S, d].
    """

    version: int
    name: str
    agent_metadata: bytes
    compatibility: PDCompatibility
    memory: str
    device_id: int
    key_address: int
    value_address: int
    hidden_address: int
    region: KVRegion
    allocated_blocks: int
    hidden_rows: int
    hidden_row_stride_bytes: int

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> TransportMetadata:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise PDCompatibilityError(f"peer metadata does not decode: {error}") from error


def check_compatibility(local: TransportMetadata, peer: TransportMetadata) -> None:
    """Raise PDCompatibilityError naming every field that differs (protocol version, the
    `PDCompatibility` fields, per-token KV geometry); return None when P and D can talk."""
    problems = []
    if local.version != peer.version:
        problems.append(f"protocol version: {local.version} here, {peer.version} there")
    problems += local.compatibility.mismatches(peer.compatibility)
    named = {problem.split(":", 1)[0] for problem in problems}
    for field in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype_bytes"):
        mine, theirs = getattr(local.region, field), getattr(peer.region, field)
        if mine != theirs and field not in named:  # tensors disagreeing with PDCompatibility
            problems.append(f"KV tensors' {field}: {mine} here, {theirs} there")
    if problems:
        raise PDCompatibilityError(
            f"refusing to connect {local.name!r} to {peer.name!r}, incompatible: "
            + "; ".join(problems)
        )
