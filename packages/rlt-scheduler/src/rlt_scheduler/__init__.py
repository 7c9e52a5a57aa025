"""rlt-scheduler: request progression, loop-level batching and exit decisions (module M3)."""

from rlt_scheduler.decode_work import DecodeWork, max_rounds_per_step
from rlt_scheduler.exit_policy import (
    DelayedHazardExitPolicy,
    ExitPolicy,
    FixedDepthExitPolicy,
    HazardExitPolicy,
    LoopBounds,
    TraceExitPolicy,
    default_exit_policy,
    make_exit_policy,
)
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.scheduler import Scheduler
from rlt_scheduler.stats import SchedulerStats

__all__ = [
    "DecodeWork",
    "max_rounds_per_step",
    "DelayedHazardExitPolicy",
    "ExitPolicy",
    "FixedDepthExitPolicy",
    "default_exit_policy",
    "TraceExitPolicy",
    "make_exit_policy",
    "LoopBounds",
    "HazardExitPolicy",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerStats",
]
