"""Admission budgets: what admitting a request would cost, in blocks (R05, R24)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from rlt_contracts import (
    AdmissionPlan,
    BlockTableUpdate,
    KVPort,
    NewRequestData,
    PrefixMatch,
    RequestBlocks,
    RequestStage,
)

from rlt_scheduler import scored_prefix
from rlt_scheduler.config import SchedulerConfig
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.step_builder import StepBuilder


class RunningGrowth(NamedTuple):
    """Blocks the running requests may still claim, and whether any request runs."""

    reserved_blocks: int
    any_running: bool


def running_growth(
    config: SchedulerConfig, kv: KVPort, running: Iterable[ScheduledRequest]
) -> RunningGrowth:
    """What running requests may still claim: up to their lifetime without preemption (so
    growth never fails), or only to the end of their prompt with preemption. O(running): an
    admission round computes it once and again only after it admits someone."""
    reserved, any_running = 0, False
    for other in running:
        any_running = True
        if config.enable_preemption:
            target = other.prompt_length if other.stage is RequestStage.PREFILL else 0
        else:
            target = other.lifetime_tokens
        reserved += max(kv.blocks_for(target) - kv.held_blocks(other.identity), 0)
    return RunningGrowth(reserved, any_running)


def headroom_blocks(config: SchedulerConfig, kv: KVPort, growth: RunningGrowth) -> int:
    """The watermark share of the pool, charged only while other requests run."""
    return int(config.watermark_ratio * kv.num_blocks) if growth.any_running else 0


def plan_admission(
    config: SchedulerConfig,
    kv: KVPort,
    request: ScheduledRequest,
    prefix: PrefixMatch,
    growth: RunningGrowth,
) -> AdmissionPlan:
    """The block budget of admitting `request` next to the running requests whose
    `running_growth` is `growth`. Pure: nothing is allocated.

    required: the request's budgeted demand minus reused prefix blocks (a resumed request needs
      back exactly what its snapshot covers). The budgeted demand is its lifetime
      (prompt + max_tokens - 1 positions), or only its prompt with incremental KV + preemption.
    reserved growth: `growth.reserved_blocks`.
    headroom: the watermark share of the pool, charged only while other requests run.
    """
    if request.preempted:
        required = kv.blocks_for(request.snapshot_tokens)
    else:
        budget_tokens = (
            request.prompt_length
            if config.incremental_kv and config.enable_preemption
            else request.lifetime_tokens
        )
        required = max(kv.blocks_for(budget_tokens) - prefix.num_blocks, 0)
    return AdmissionPlan(
        required_blocks=required,
        reserved_growth_blocks=growth.reserved_blocks,
        headroom_blocks=headroom_blocks(config, kv, growth),
        cached_claim_blocks=prefix.cached_claim_blocks,
        reusable_prefix_tokens=prefix.num_tokens,
    )


def initial_allocation_tokens(
    config: SchedulerConfig, request: ScheduledRequest, prefix: PrefixMatch
) -> int:
    """Positions claimed at admission: the lifetime, or with incremental KV the first chunk."""
    if config.incremental_kv:
        return min(request.prompt_length, prefix.num_tokens + config.prefill_chunk_size)
    return request.lifetime_tokens


def start_admitted(
    request: ScheduledRequest,
    prefix: PrefixMatch,
    updates: tuple[BlockTableUpdate, ...],
    step: StepBuilder,
    *,
    scheduled_time: float,
) -> None:
    """A new request got its first blocks (`updates`, reusing `prefix`) and joined the running
    list: it enters PREFILL with the reused prefix counted as scheduled and computed (a scored
    prompt takes the reused pages' scores), and the step introduces it to the runner (request
    data, then its block mapping). Selected into the
    step, so it is never a preemption victim of its own step. `scheduled_time`: host monotonic
    seconds of its first admission."""
    request.stage = RequestStage.PREFILL
    request.scheduled_time = scheduled_time
    request.scheduled_prompt_tokens = request.computed_prompt_tokens = prefix.num_tokens
    scored_prefix.take_cached_scores(request, prefix)
    request.known_to_runner = True
    step.selected.add(request.identity)
    step.new_requests.append(
        NewRequestData(
            request.identity,
            request.sampling,
            request.prompt_length,
            request.rule,
            prefill_only=request.prefill_only,
            prompt_token_ids=request.prompt_token_ids,
        )
    )
    step.block_updates.append(RequestBlocks(request.identity, updates))
