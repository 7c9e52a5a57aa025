"""Preemption policy: which running request to suspend (a decision, not a mechanism, R04).

The scheduler suspends the chosen victim (queue transition, logical KV release); the runner
saves and restores its device state. Nothing here touches queues or device state.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from rlt_contracts import ExecutionIdentity

from rlt_scheduler.request_state import ScheduledRequest


def choose_victim(
    running: Iterable[ScheduledRequest],
    *,
    excluded: Collection[ExecutionIdentity],
    held_blocks: Callable[[ExecutionIdentity], int],
    worse_than_priority: int | None = None,
) -> ScheduledRequest | None:
    """The running request to preempt, or None.

    Eligible: running requests not in `excluded` (the requester and everything already selected
    into the step being built) that hold blocks; with `worse_than_priority`, only requests whose
    priority value is strictly greater (lower priority). Ranking: lowest priority first (largest
    value), then the most blocks held (frees the most memory per preemption).
    """
    candidates = [
        r
        for r in running
        if r.identity not in excluded
        and held_blocks(r.identity) > 0
        and (worse_than_priority is None or r.sampling.priority > worse_than_priority)
    ]
    if not candidates:
        return None
    return max(
        candidates, key=lambda r: (r.sampling.priority, held_blocks(r.identity), r.arrival_index)
    )
