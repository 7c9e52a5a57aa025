"""Prefill/decode disaggregation (M9): KV handoff planning and D-side receive tracking.

Pure logic only so far (no transport, no processes); see README.md for what is not built yet.
"""

from rlt_pd.handoff import (
    DEFAULT_MAX_TRANSFER_DESCRIPTORS,
    DEFAULT_TRANSFER_CHUNK_BYTES,
    HandoffPlan,
    TransferDescriptor,
    TransferPartition,
    plan_handoff,
)
from rlt_pd.receive import Delivery, HandoffProtocolError, ReceiveTracker
from rlt_pd.region import KVRegion, KVTensor

__all__ = [
    "DEFAULT_MAX_TRANSFER_DESCRIPTORS",
    "DEFAULT_TRANSFER_CHUNK_BYTES",
    "Delivery",
    "HandoffPlan",
    "HandoffProtocolError",
    "KVRegion",
    "KVTensor",
    "ReceiveTracker",
    "TransferDescriptor",
    "TransferPartition",
    "plan_handoff",
]
