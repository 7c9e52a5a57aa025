"""`RequestOutput`: the cumulative result of one request as the Python API returns it."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_contracts import FinishReason, HandoffTarget, RequestTimings, TokenLog, TokenLogColumns


@dataclass
class RequestOutput(TokenLogColumns):
    """Everything generated so far for one request.

    tokens: the per-token columns (`rlt_contracts.TokenColumns`), aligned: token_ids,
    exit_depths (exit_depths[i] is the number of loops the hidden state that produced token i
    went through; token 0 comes from prefill at full depth), logprobs and top_logprobs (None
    unless the request asked for logprobs); the four are also attributes of the output itself.
    prompt_logprobs / prompt_token_ranks / prompt_top_logprobs (`SamplingParams.prompt_logprobs`):
    one entry per prompt token, None for the first, at full depth; set with token 0.
    prompt_exit_depths: with `SamplingParams.score_at_exit_depth`, the loop at which each prompt
    position was scored (None for the first), aligned with prompt_logprobs.
    text is detokenized as the request's text options say (SamplingParams: by default special
    tokens are skipped, and a matched stop string or the stop token's text is not included).
    """

    request_id: str
    prompt_token_ids: list[int]
    tokens: TokenLog = field(default_factory=TokenLog)
    text: str = ""
    prompt_logprobs: list[float | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_exit_depths: list[int | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    seed: int | None = None
    error: str | None = None
    timings: RequestTimings | None = None  # lifecycle timestamps, once finished
    kv_target: HandoffTarget | None = None  # PD decode: where the prefill instance writes

    @property
    def mean_loops(self) -> float:
        """Mean exit depth of the decoded tokens (token 0 excluded; 0.0 if there are none)."""
        decoded = self.exit_depths[1:]
        return sum(decoded) / len(decoded) if decoded else 0.0
