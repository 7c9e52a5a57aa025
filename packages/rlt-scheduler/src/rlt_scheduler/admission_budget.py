"""Admission budgets: what admitting a request would cost, in blocks (R05, R24).

Pure: nothing is allocated and no request changes; `admitter.py` acts on the answers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from rlt_contracts import AdmissionPlan, KVPort, PrefixMatch, RequestStage, SchedulerConfig

from rlt_scheduler.request_state import ScheduledRequest


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
