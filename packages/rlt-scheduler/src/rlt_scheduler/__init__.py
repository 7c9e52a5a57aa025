"""rlt-scheduler: request progression, loop-level batching and exit decisions (module M3)."""

from rlt_scheduler.config import SchedulerConfig, SchedulingMode
from rlt_scheduler.exit_policy import ExitPolicy, LoopBounds, OuroExitPolicy, TokenExitState
from rlt_scheduler.kv_port import KVPort
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.scheduler import Scheduler
from rlt_scheduler.stats import SchedulerStats

__all__ = [
    "ExitPolicy",
    "KVPort",
    "LoopBounds",
    "OuroExitPolicy",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulingMode",
    "TokenExitState",
]
