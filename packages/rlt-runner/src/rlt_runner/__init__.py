"""rlt-runner: device state, KV storage and batch execution (module M5)."""

from rlt_runner.kv_storage import FP8, KVScales, KVStorage
from rlt_runner.memory import (
    ActivationProfile,
    KVMemoryPlan,
    plan_kv_blocks,
    profile_activation_peak,
    profile_blocks,
)
from rlt_runner.model_runner import ModelRunner
from rlt_runner.pd_regions import PDRegions
from rlt_runner.readback import PendingStep
from rlt_runner.row_record import RowRecord
from rlt_runner.row_state import DecodeRows
from rlt_runner.snapshots import SnapshotStore

__all__ = [
    "ActivationProfile",
    "DecodeRows",
    "KVMemoryPlan",
    "FP8",
    "KVScales",
    "KVStorage",
    "ModelRunner",
    "PDRegions",
    "PendingStep",
    "RowRecord",
    "SnapshotStore",
    "plan_kv_blocks",
    "profile_activation_peak",
    "profile_blocks",
]
