"""`ScheduledRequest`: the scheduler-side state of one admitted or waiting request.

Only the scheduler writes these fields (R02). Device state (hidden states, the looping token,
loop progress and exit state, KV tensors) lives in the runner and is addressed by `identity`.

Progress points are kept apart (R18): what was *submitted* (scheduled_prompt_tokens,
unconfirmed_tokens) moves ahead of what the device *completed* and the host read back
(computed_prompt_tokens, output_token_ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_contracts import (
    DecodeRule,
    ExecutionIdentity,
    FinishReason,
    KVTransferParams,
    PDRole,
    RequestOutputDelta,
    RequestStage,
    RequestTimings,
    SamplingParams,
    TokenConstraint,
    TokenLog,
)

from rlt_scheduler.exit_policy import LoopBounds


@dataclass(eq=False)
class ScheduledRequest:
    """Progress of one request (an entity: compared by identity, not by field values).

    Positions: the prompt occupies [0, prompt_length); output token i is fed back at position
    prompt_length + i.
    """

    identity: ExecutionIdentity
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # seed resolved
    bounds: LoopBounds
    rule: DecodeRule
    arrival_index: int
    stage: RequestStage = RequestStage.WAITING
    scheduled_prompt_tokens: int = 0  # prompt positions submitted to the device
    computed_prompt_tokens: int = 0  # prompt positions [0, n) confirmed to hold KV at all depths
    unconfirmed_tokens: int = 0  # upper bound of outputs made by submitted, unread steps
    confirmed_ticks: int = 0  # decode ticks it took part in, of steps already read back
    # the outputs' per-token columns recorded so far (ids, exit depths, logprobs, ...)
    outputs: TokenLog = field(init=False)
    # prompt_logprobs: token i's (log-probability, rank, top) at index i - 1, chunk by chunk;
    # with score_at_exit_depth, prompt_exit_depths[i - 1]: the loops of the state that scored it
    prompt_scores: list[tuple[float, int, tuple[tuple[int, float], ...]]] = field(
        default_factory=list
    )
    prompt_exit_depths: list[int] = field(default_factory=list)
    known_to_runner: bool = False
    bypass_count: int = 0  # admissions of later requests while this one waited (bounded bypass)
    snapshot_tokens: int | None = None  # preempted: positions its device snapshot covers
    resume_stage: RequestStage | None = None  # preempted: the stage it resumes in
    finish_reason: FinishReason | None = None
    error: str | None = None
    delivered_tokens: int = 0  # outputs already reported in a delta
    # the loops its prompt runs (its max_loops) when fewer than the model's, else None: such
    # a prompt's KV differs from a full-depth one's (its prefix-cache salt says so)
    prompt_loops: int | None = None
    kv_transfer: KVTransferParams | None = None  # PD role of this request, if any
    kv_landed: bool = False  # PD decode: the handoff completed; starts at the next step
    # structured output: the grammar matcher, which has consumed exactly the outputs recorded
    # so far; `mask_sent`: the mask of the next output is on the device (its token may come in
    # a step in flight), so the next mask waits until that token is read back; `mask_ticks`:
    # ticks scheduled since that mask (its token has come once they reach max_loops)
    constraint: TokenConstraint | None = None
    mask_sent: bool = False
    mask_ticks: int = 0
    # chained keys of the prompt's publishable pages under its salt (prefix_waits.page_keys)
    prompt_page_keys: tuple[bytes, ...] | None = None
    # lifecycle timestamps (host time.monotonic(); see rlt_contracts.RequestTimings)
    queued_time: float = 0.0  # accepted by add_request
    scheduled_time: float | None = None  # first admitted
    first_token_time: float | None = None  # results holding output 0 applied
    last_token_time: float | None = None  # results holding the latest output applied

    def __post_init__(self) -> None:
        self.outputs = TokenLog.for_request(self.sampling)

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs.token_ids

    @property
    def exit_depths(self) -> list[int]:
        return self.outputs.exit_depths

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_only(self) -> bool:
        """PD prefill: the prompt is computed here and sent; no token is generated here."""
        return self.kv_transfer is not None and self.kv_transfer.role is PDRole.PREFILL

    @property
    def awaits_kv(self) -> bool:
        """PD decode: the prompt's KV is written here by a prefill instance."""
        return self.kv_transfer is not None and self.kv_transfer.role is PDRole.DECODE

    @property
    def lifetime_tokens(self) -> int:
        """Positions the request can ever write: the last output is never fed back (a PD
        prefill request writes only its prompt)."""
        if self.prefill_only:
            return self.prompt_length
        return self.prompt_length + self.sampling.max_tokens - 1

    @property
    def preempted(self) -> bool:
        return self.snapshot_tokens is not None

    @property
    def finished(self) -> bool:
        return self.stage is RequestStage.FINISHED

    @property
    def loops_into_token(self) -> int:
        """Loops the token now looping has run, as of the read-back results (refill mode: a
        decoding row loops in every tick it takes part in)."""
        return self.confirmed_ticks - sum(self.exit_depths[1:])

    def kv_tokens_needed(self, outputs_bound: int) -> int:
        """Positions the blocks must cover while the request has at most `outputs_bound`
        outputs: the looping token (output n - 1) writes position P + n - 1."""
        return min(self.prompt_length + outputs_bound, self.lifetime_tokens)

    def timings(self) -> RequestTimings:
        return RequestTimings(
            queued=self.queued_time,
            scheduled=self.scheduled_time,
            first_token=self.first_token_time,
            last_token=self.last_token_time,
        )

    def take_delta(self) -> RequestOutputDelta:
        """Outputs produced since the previous delta (and the finish, if any; the final delta
        carries the request's timings)."""
        start, self.delivered_tokens = self.delivered_tokens, self.num_outputs
        scored = self.sampling.prompt_logprobs is not None and start == 0 and self.num_outputs > 0
        return RequestOutputDelta(
            request_id=self.identity.request_id,
            **self.outputs.since(start),
            prompt_logprobs=(None, *(s[0] for s in self.prompt_scores)) if scored else None,
            prompt_token_ranks=(None, *(s[1] for s in self.prompt_scores)) if scored else None,
            prompt_top_logprobs=(None, *(s[2] for s in self.prompt_scores)) if scored else None,
            prompt_exit_depths=(None, *self.prompt_exit_depths)
            if scored and self.sampling.score_at_exit_depth
            else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.prompt_length,
            resolved_seed=self.sampling.seed,
            error=self.error,
            timings=self.timings() if self.finished else None,
        )
