"""`RequestQueues`: the scheduler's waiting queue, running list and held PD handoffs.

`Scheduler` creates the one instance and is its owner (R02); admission (`admitter.py`) and
step building (`step_planner.py`) receive it explicitly, so every piece moves requests
between the same queues instead of keeping a copy.
"""

from __future__ import annotations

from rlt_contracts import SchedulingPolicy

from rlt_scheduler.pd_stages import PDHandoffs
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.waiting_queue import WaitingQueue


class RequestQueues:
    """waiting: new and preempted requests in policy order. running: admitted requests, in
    admission order. handoffs (PD): finished requests whose blocks and row stay held, and decode
    requests awaiting their KV."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.waiting = WaitingQueue(policy)
        self.running: list[ScheduledRequest] = []
        self.handoffs = PDHandoffs()

    @property
    def occupied_slots(self) -> int:
        """Runner rows in use: running requests plus finished PD requests still held."""
        return len(self.running) + self.handoffs.num_held
