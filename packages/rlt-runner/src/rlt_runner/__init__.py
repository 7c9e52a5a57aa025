"""rlt-runner: device state, KV storage and batch execution (module M5)."""

from rlt_runner.kv_storage import KVStorage
from rlt_runner.memory import KVMemoryPlan, plan_kv_blocks
from rlt_runner.model_runner import ModelRunner
from rlt_runner.request_slots import RequestSlots
from rlt_runner.snapshots import SnapshotStore

__all__ = [
    "KVMemoryPlan",
    "KVStorage",
    "ModelRunner",
    "RequestSlots",
    "SnapshotStore",
    "plan_kv_blocks",
]
