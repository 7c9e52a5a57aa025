"""rlt-scheduler: request progression, loop-level batching and exit decisions (module M3)."""

from rlt_scheduler.config import SchedulerConfig, SchedulingMode, SchedulingPolicy
from rlt_scheduler.decode_work import DecodeWork, max_rounds_per_step
from rlt_scheduler.exit_policy import (
    POLICY_ALIASES,
    POLICY_CHOICES,
    DelayedHazardExitPolicy,
    ExitPolicy,
    ExitPolicyName,
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
    "ExitPolicyName",
    "FixedDepthExitPolicy",
    "POLICY_ALIASES",
    "POLICY_CHOICES",
    "default_exit_policy",
    "TraceExitPolicy",
    "make_exit_policy",
    "SchedulingPolicy",
    "LoopBounds",
    "HazardExitPolicy",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulingMode",
]
