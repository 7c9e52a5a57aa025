"""Preemption, the scheduler's side (R04): choosing a victim, suspending it, resuming it.

`choose_victim` decides whom to suspend; `suspend` and `resume` carry out the queue transition
and the logical KV release, and record what the runner must do in the step being built
(`snapshots`, `restores`). A suspended request resumes exactly where it was (same stage, loops,
exit state and grammar matcher); the snapshot itself is the runner's. The scheduler's queues
and counters are passed in and change only through these transitions (README.md, "Modules").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from rlt_contracts import (
    NO_PREFIX,
    ExecutionIdentity,
    KVPort,
    PrefixMatch,
    RequestBlocks,
    RequestStage,
    SchedulerConfig,
)

from rlt_scheduler.admission_budget import plan_admission, running_growth
from rlt_scheduler.constrained import decode_output_bound, send_mask_if_due
from rlt_scheduler.decode_work import DecodeWork
from rlt_scheduler.pd_stages import transfer_endpoints
from rlt_scheduler.request_queues import RequestQueues
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder


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


def suspend(
    victim: ScheduledRequest,
    step: StepBuilder,
    *,
    queues: RequestQueues,
    kv: KVPort,
    stats: SchedulerStats,
) -> None:
    """Suspend `victim`: the runner snapshots its device state first thing in this step; its
    blocks are free for the rest of the step; it waits to be resumed exactly where it was."""
    step.snapshots.append(victim.identity)
    victim.snapshot_tokens = kv.allocated_tokens(victim.identity)
    victim.resume_stage = victim.stage
    kv.free(victim.identity)
    queues.running.remove(victim)
    victim.stage = RequestStage.WAITING
    queues.waiting.add(victim)
    stats.preemptions += 1


def grow_or_preempt(
    request: ScheduledRequest,
    num_tokens: int,
    step: StepBuilder,
    *,
    may_suspend: bool,
    enable_preemption: bool,
    queues: RequestQueues,
    kv: KVPort,
    stats: SchedulerStats,
) -> bool:
    """Make the request's blocks cover positions [0, num_tokens), preempting another request
    once if that is allowed and needed. A decoding request that still cannot grow is
    suspended itself (`may_suspend`), since the device would otherwise run it. False: the
    request does not run in this step."""
    updates = kv.grow(request.identity, num_tokens)
    if updates is None and enable_preemption:
        victim = choose_victim(
            queues.running,
            excluded=step.selected | {request.identity} | transfer_endpoints(queues.running),
            held_blocks=kv.held_blocks,
        )
        if victim is not None:
            suspend(victim, step, queues=queues, kv=kv, stats=stats)
            updates = kv.grow(request.identity, num_tokens)
    if updates is None:
        if not may_suspend:
            return False
        if not enable_preemption:
            raise RuntimeError(
                f"{request.identity}: KV growth failed although admission reserved it"
            )
        suspend(request, step, queues=queues, kv=kv, stats=stats)
        return False
    if updates:
        step.block_updates.append(RequestBlocks(request.identity, updates))
    return True


def preempt_for_head(
    head: ScheduledRequest,
    prefix: PrefixMatch,
    step: StepBuilder,
    *,
    config: SchedulerConfig,
    queues: RequestQueues,
    kv: KVPort,
    stats: SchedulerStats,
) -> None:
    """While the head of the queue cannot be admitted (no slot, or its `AdmissionPlan` with
    `prefix` does not fit), suspend strictly lower-priority running requests, worst first;
    stop when none is left to suspend."""
    running = queues.running
    while len(running) >= config.max_num_seqs or not plan_admission(
        config, kv, head, prefix, running_growth(config, kv, running)
    ).fits(kv.capacity().free_blocks):
        victim = choose_victim(
            running,
            excluded=step.selected | transfer_endpoints(running),
            held_blocks=kv.held_blocks,
            worse_than_priority=head.sampling.priority,
        )
        if victim is None:
            return
        suspend(victim, step, queues=queues, kv=kv, stats=stats)


def resume(
    request: ScheduledRequest,
    work: DecodeWork,
    step: StepBuilder,
    *,
    queues: RequestQueues,
    kv: KVPort,
    stats: SchedulerStats,
) -> bool:
    """Give a preempted request blocks covering its snapshot; the runner restores it
    before this step's work. It continues from the same stage, loop and exit state: a
    decoding request also gets the blocks of this step's decode and loops in it, a
    prefilling one continues with its next chunk from the next step on. False: no blocks now,
    or no room in a full speculative step (nothing changed)."""
    tokens, bound = request.snapshot_tokens, 0
    if request.resume_stage is RequestStage.DECODING:
        if not step.can_start_decoding():
            return False
        bound = decode_output_bound(request, work)
        outputs = request.num_outputs + request.unconfirmed_tokens + bound
        tokens = max(tokens, request.kv_tokens_needed(outputs))
    updates = kv.allocate(request.identity, tokens, NO_PREFIX)
    if updates is None:
        return False
    queues.waiting.remove(request)
    queues.running.append(request)
    request.stage = request.resume_stage
    request.snapshot_tokens = request.resume_stage = None
    step.block_updates.append(RequestBlocks(request.identity, updates))
    step.restores.append(request.identity)
    stats.resumptions += 1
    if request.stage is RequestStage.DECODING:
        step.take_looping_row()
        step.add_decode(request.identity, bound)
        send_mask_if_due(request, step)  # after the restore (runner order)
    else:
        step.selected.add(request.identity)
    return True
