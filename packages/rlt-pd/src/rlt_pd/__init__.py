"""Prefill/decode disaggregation (M9): KV handoff planning, control messages, the NIXL transport
and the prefill-/decode-side connectors. See README.md.

Nothing here imports torch; `KVTransport` (rlt_pd.transport, which needs nixl) is imported lazily
on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt_pd.handoff import (
    DEFAULT_MAX_TRANSFER_DESCRIPTORS,
    DEFAULT_TRANSFER_CHUNK_BYTES,
    HandoffPlan,
    TransferDescriptor,
    TransferPartition,
    plan_handoff,
)
from rlt_pd.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Commit,
    ControlMessage,
    Drained,
    Landed,
    PDCompatibilityError,
    PDTransportError,
    TransportMetadata,
    check_compatibility,
    decode_message,
    encode_message,
)
from rlt_pd.port import TransportHandoffPort
from rlt_pd.receive import Delivery, HandoffProtocolError, ReceiveTracker
from rlt_pd.receiver import KVReceiver, ReceiveEvent, ReceiveOutcome, ReceiverConfig
from rlt_pd.region import KVRegion, KVTensor
from rlt_pd.sender import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    KVSender,
    SenderConfig,
    SendEvent,
    SendOutcome,
)
from rlt_pd.transport_api import Transport, TransportPoll

if TYPE_CHECKING:
    from rlt_pd.transport import KVTransport

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MAX_TRANSFER_DESCRIPTORS",
    "DEFAULT_TRANSFER_CHUNK_BYTES",
    "PROTOCOL_VERSION",
    "Cancel",
    "Commit",
    "ControlMessage",
    "Delivery",
    "Drained",
    "HandoffPlan",
    "HandoffProtocolError",
    "KVReceiver",
    "KVRegion",
    "KVSender",
    "KVTensor",
    "KVTransport",
    "Landed",
    "PDCompatibilityError",
    "PDTransportError",
    "ReceiveEvent",
    "ReceiveOutcome",
    "ReceiveTracker",
    "ReceiverConfig",
    "SendEvent",
    "SendOutcome",
    "SenderConfig",
    "TransferDescriptor",
    "TransferPartition",
    "Transport",
    "TransportMetadata",
    "TransportHandoffPort",
    "TransportPoll",
    "check_compatibility",
    "decode_message",
    "encode_message",
    "plan_handoff",
]


def __getattr__(name: str):
    if name == "KVTransport":
        from rlt_pd.transport import KVTransport

        return KVTransport
    raise AttributeError(f"module 'rlt_pd' has no attribute {name!r}")
