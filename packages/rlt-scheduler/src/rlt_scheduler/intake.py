"""Request intake: the waiting-room limit and building a request's scheduling state.

Both run in `Scheduler.add_requests` after validation (`validation.py`) and before anything is
queued: `check_waiting_room` raises without changing state; `build_scheduled_request` is pure
apart from drawing a seed for a request that has none.
"""

from __future__ import annotations

import secrets

from msgspec import structs
from rlt_contracts import (
    DecodeRule,
    EngineRequest,
    ExecutionIdentity,
    InvalidRequestError,
    OverloadedError,
    SchedulerConfig,
    TokenConstraint,
)

from rlt_scheduler.exit_policy import ExitPolicy, LoopBounds
from rlt_scheduler.request_state import ScheduledRequest


def check_waiting_room(
    config: SchedulerConfig,
    *,
    count: int,
    queued: int,
    fresh_waiting: int,
    running: int,
    held: int,
) -> None:
    """Raise unless `count` more requests fit the waiting room.

    `max_waiting_requests` bounds the requests that really wait: those a step already
    left waiting (`queued - fresh_waiting`: no slot, KV or budget for them), plus the ones
    queued since the last step (`fresh_waiting`, and the `count` new ones) beyond the runner
    slots free now (a free slot takes such a request at the next step; none is free for them
    while older requests were left waiting, since what holds those back holds them too).
    `running` and `held` (PD) requests occupy slots. A batch larger than the limit plus every
    slot can never be queued (InvalidRequestError); otherwise OverloadedError.
    """
    if count > config.max_waiting_requests + config.max_num_seqs:
        raise InvalidRequestError(
            "prompt",
            f"{count} prompts at once exceed what the engine can queue "
            f"({config.max_waiting_requests} waiting + {config.max_num_seqs} running)",
        )
    left_waiting = queued - fresh_waiting
    free_slots = 0
    if not left_waiting:
        free_slots = max(config.max_num_seqs - running - held, 0)
    waiting = left_waiting + max(fresh_waiting + count - free_slots, 0)
    if waiting > config.max_waiting_requests:
        raise OverloadedError(
            f"{queued} requests are queued and {free_slots} runner slots are "
            f"free for them: {count} more would leave {waiting} waiting (limit "
            f"{config.max_waiting_requests}); retry later"
        )


def build_scheduled_request(
    new: EngineRequest,
    prompt: tuple[int, ...],
    bounds: LoopBounds,
    constraint: TokenConstraint | None,
    *,
    generation: int,
    exit_policy: ExitPolicy,
    eos_token_ids: tuple[int, ...],
    queued_time: float,
    model_depth: int,
    draft_tokens: int = 0,
) -> ScheduledRequest:
    """The scheduling state of a validated request: identity (`generation` is also its arrival
    index), a seed if none was given, and its `DecodeRule` (exit rule compiled once, stop ids
    including EOS unless `ignore_eos`, one output per step under a grammar, `draft_tokens`
    drafts per speculative round; `prompt_loops` when its prompt runs fewer loops than the
    model's `model_depth`)."""
    request_id, sampling = new.request_id, new.sampling
    if sampling.seed is None:
        sampling = structs.replace(sampling, seed=secrets.randbits(63))
    stop_ids = tuple(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids += tuple(t for t in eos_token_ids if t not in stop_ids)
    return ScheduledRequest(
        identity=ExecutionIdentity(request_id, generation),
        prompt_token_ids=prompt,
        sampling=sampling,
        bounds=bounds,
        rule=DecodeRule(
            exit=exit_policy.rule(request_id, bounds, sampling.max_tokens),
            max_tokens=sampling.max_tokens,
            stop_token_ids=stop_ids,
            one_output_per_step=constraint is not None,
            num_speculative_tokens=draft_tokens,
        ),
        arrival_index=generation,
        queued_time=queued_time,
        prompt_loops=bounds.max_loops if bounds.max_loops < model_depth else None,
        kv_transfer=new.kv_transfer,
        constraint=constraint,
    )
