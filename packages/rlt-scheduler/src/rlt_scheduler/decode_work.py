"""What a step's decoding rows run: loop ticks, or self-speculative rounds (`DecodeWork`).

The rules (which requests draft, whether a step speculates, how many rounds) are README.md's
"Speculative rounds"; the runner's side is rlt-runner's README, "Speculative rounds". Measured
reasons behind them, on an H200: a round per prompt step ran 0.83x end to end at 32 requests
arriving at once (a round costs about (K + 1) D + T - D loops and would hold every chunk up);
queueing rounds past what the submitted steps can already finish ran a 2-round step (18 ms,
4.6% of decode) after the last token at one request; a round for a request that cannot draft
took 13 ms against 7 ms of ticks. A rule that ticked when no request could draft *if every
draft in flight were accepted* ticked whole steps where drafts were still useful (3% slower).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rlt_contracts import (
    ExecutionIdentity,
    RequestStage,
    SamplingParams,
    SchedulerConfig,
    SchedulingMode,
    SpeculationConfig,
)

from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.tick_policy import decode_ticks, prompts_pending, tick_output_bound


@dataclass(frozen=True)
class DecodeWork:
    """A step's decode: `ticks` loop ticks, or `rounds` speculative rounds (never both)."""

    ticks: int = 0
    rounds: int = 0

    @property
    def speculative(self) -> bool:
        return self.rounds > 0

    def output_bound(self, request: ScheduledRequest, *, fresh: bool) -> int:
        """Most outputs the step's decode can make for `request`, token 0 not included
        (`fresh`: its token 0 comes from this step, so no token is looping yet)."""
        if self.rounds:
            return self.rounds * (request.rule.num_speculative_tokens + 1)
        return tick_output_bound(request, self.ticks, fresh=fresh)

    def mask_loops(self, request: ScheduledRequest) -> int:
        """Loops the step counts against a constrained request's current mask: its ticks, or
        all its loops (a round always finishes the token it starts with)."""
        return request.bounds.max_loops if self.rounds else self.ticks


def draft_tokens(speculation: SpeculationConfig, sampling: SamplingParams) -> int:
    """Drafts per round for a request with these parameters (module doc)."""
    if sampling.penalized or sampling.structured_output is not None:
        return 0
    return speculation.num_tokens


def decode_work(
    config: SchedulerConfig,
    speculation: SpeculationConfig,
    running: Iterable[ScheduledRequest],
    unconfirmed_ticks: Mapping[ExecutionIdentity, int],
    unconfirmed_rounds: Mapping[ExecutionIdentity, int],
    *,
    admission_possible: bool,
    model_depth: int,
    start_deferred: bool,
) -> DecodeWork:
    """The next step's decode (module doc). `start_deferred`: the previous step was
    speculative and full, and a request that could have started decoding waited."""
    running = list(running)
    ticks = decode_ticks(
        config,
        running,
        unconfirmed_ticks,
        admission_possible=admission_possible,
        model_depth=model_depth,
    )
    if not speculation.num_tokens or start_deferred:
        return DecodeWork(ticks=ticks)
    decoding = [r for r in running if r.stage is RequestStage.DECODING]
    limit = speculation.disable_batch_size
    if limit is not None and len(decoding) > limit:
        return DecodeWork(ticks=ticks)
    if prompts_pending(running, admission_possible=admission_possible):
        # ticks (`prefill_step_decode_ticks`): a round would hold every prompt chunk up
        return DecodeWork(ticks=ticks)
    in_flight = [
        (r, unconfirmed_rounds.get(r.identity, 0), unconfirmed_ticks.get(r.identity, 0))
        for r in decoding
    ]
    if decoding and not any(can_draft(config, *entry) for entry in in_flight):
        return DecodeWork(ticks=ticks)  # a round without drafts costs more than its ticks
    most = max_rounds_per_step(config, model_depth)
    needed = max((rounds_until_done_at_best(r, rounds) for r, rounds, _ in in_flight), default=0)
    return DecodeWork(rounds=min(most, needed))


def can_draft(
    config: SchedulerConfig, request: ScheduledRequest, rounds_in_flight: int, ticks_in_flight: int
) -> bool:
    """Whether `request`'s next round could make a draft at all: it drafts, and more than one
    token is left even if the steps in flight make the most tokens they surely make (a round
    drafts at most max_tokens - outputs - 1; every round makes a token, and in refill mode a
    decoding row loops in every tick, so T ticks finish a token)."""
    if not request.rule.num_speculative_tokens:
        return False
    left = request.sampling.max_tokens - request.num_outputs - rounds_in_flight
    if config.mode is SchedulingMode.REFILL:
        depth = request.bounds.max_loops
        to_finish = depth - request.loops_into_token
        if ticks_in_flight >= to_finish:
            left -= 1 + (ticks_in_flight - to_finish) // depth
    return left >= 2


def rounds_until_done_at_best(request: ScheduledRequest, in_flight: int) -> int:
    """More rounds after the `in_flight` submitted ones before `request` could reach
    max_tokens: with every draft accepted a round emits K + 1 tokens (module doc)."""
    left = request.sampling.max_tokens - request.num_outputs
    per_round = request.rule.num_speculative_tokens + 1
    return max(0, -(-left // per_round) - in_flight)


def max_rounds_per_step(config: SchedulerConfig, model_depth: int) -> int:
    """The most rounds `decode_work` ever puts in one step (the runner sizes its rings)."""
    return max(1, config.decode_ticks_per_step // model_depth)
