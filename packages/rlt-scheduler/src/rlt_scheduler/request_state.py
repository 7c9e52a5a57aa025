"""`ScheduledRequest`: the scheduler-side state of one admitted or waiting request.

Only the scheduler writes these fields (R02). Device state (hidden states, pending tokens, KV
tensors) lives in the runner and is addressed by `identity`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_contracts import (
    ExecutionIdentity,
    FinishReason,
    RequestOutputDelta,
    RequestStage,
    SamplingParams,
)

from rlt_scheduler.exit_policy import LoopBounds, TokenExitState


@dataclass(eq=False)
class ScheduledRequest:
    """Progress of one request (an entity: compared by identity, not by field values).

    Positions: the prompt occupies [0, prompt_length); output token i is fed back at position
    prompt_length + i. `loops_done` counts loops of the token currently looping (the latest
    output), `exit_depth` is set once it exited and waits for coda.
    """

    identity: ExecutionIdentity
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # seed resolved
    bounds: LoopBounds
    arrival_index: int
    stage: RequestStage = RequestStage.WAITING
    computed_prompt_tokens: int = 0  # prompt positions [0, n) hold KV at every depth
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    loops_done: int = 0
    exit_state: TokenExitState = field(default_factory=TokenExitState)
    exit_depth: int | None = None
    known_to_runner: bool = False
    bypass_count: int = 0  # admissions of later requests while this one waited (bounded bypass)
    snapshot_tokens: int | None = None  # preempted: positions its device snapshot covers
    resume_stage: RequestStage | None = None  # preempted: the stage it resumes in
    finish_reason: FinishReason | None = None
    error: str | None = None
    delivered_tokens: int = 0  # outputs already reported in a delta

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    @property
    def looping_position(self) -> int:
        """Position of the token currently looping (the latest output fed back)."""
        return self.prompt_length + self.num_outputs - 1

    @property
    def lifetime_tokens(self) -> int:
        """Positions the request can ever write: the last output is never fed back."""
        return self.prompt_length + self.sampling.max_tokens - 1

    @property
    def preempted(self) -> bool:
        return self.snapshot_tokens is not None

    @property
    def finished(self) -> bool:
        return self.stage is RequestStage.FINISHED

    def wants_continuation(self) -> bool:
        """After the next coda, is another token still needed (so its loop 1 may start)?"""
        return self.num_outputs + 1 < self.sampling.max_tokens

    def start_token(self) -> None:
        """The latest output starts looping (prelude): reset per-token loop and exit state."""
        self.loops_done = 0
        self.exit_state = TokenExitState()
        self.exit_depth = None

    def take_delta(self) -> RequestOutputDelta:
        """Outputs produced since the previous delta (and the finish, if any)."""
        start, self.delivered_tokens = self.delivered_tokens, self.num_outputs
        wants_logprobs = self.sampling.logprobs is not None
        return RequestOutputDelta(
            request_id=self.identity.request_id,
            token_ids=tuple(self.output_token_ids[start:]),
            exit_depths=tuple(self.exit_depths[start:]),
            logprobs=tuple(self.logprobs[start:]) if wants_logprobs else None,
            top_logprobs=tuple(self.top_logprobs[start:]) if wants_logprobs else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.prompt_length,
            resolved_seed=self.sampling.seed,
            error=self.error,
        )
