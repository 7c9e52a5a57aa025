"""What the engine reports to its frontends: per-request output deltas and engine statistics."""

from __future__ import annotations

import msgspec

from rlt_contracts.pd import HandoffTarget, KVTransferParams
from rlt_contracts.requests import FinishReason
from rlt_contracts.sampling import SamplingParams
from rlt_contracts.tokens import TokenColumns


class EngineRequest(msgspec.Struct, frozen=True):
    """A request as submitted to an `EngineClient`.

    prompt_token_ids: the tokenized prompt (non-empty, every id < the vocabulary size).
    arrival_time: seconds since the epoch (time.time()) when the frontend received it.
    kv_transfer: PD only (see rlt_contracts.pd): on a decode instance, wait for the prompt's KV
      from a prefill instance; on a prefill instance, compute the prompt and push its KV.
    sibling_group: a hint that requests carrying the same group name share their prompt (the
      n choices of one prompt), kept across front ends and PD; the scheduler no longer reads
      it (its prefix waits cover a group). None: no group.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0
    kv_transfer: KVTransferParams | None = None
    sibling_group: str | None = None


class RequestTimings(msgspec.Struct, frozen=True):
    """When the engine saw one request's lifecycle events (reported on its final delta).

    Every timestamp is the engine host's `time.monotonic()`: only differences between them are
    meaningful (not comparable with `EngineRequest.arrival_time`, the wall clock, or another
    process's clock). The engine runs asynchronously, so token events are taken when the host
    applies a step's results, which is after the next step was already submitted.

    queued: the scheduler accepted the request (add_request).
    scheduled: it was first admitted (its first prefill chunk scheduled); None if never. A
      preempted request resumes where it was, so later re-admissions do not move it.
    first_token: the results holding token 0 were applied; None if it produced no token.
    last_token: the results holding its last token were applied; None if it produced none.
    """

    queued: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    @property
    def queue_time(self) -> float | None:
        """queued -> scheduled (waiting for admission)."""
        return None if self.scheduled is None else self.scheduled - self.queued

    @property
    def prefill_time(self) -> float | None:
        """scheduled -> first token (prompt computation and token 0)."""
        if self.scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.scheduled

    @property
    def decode_time(self) -> float | None:
        """first token -> last token (0.0 for a one-token request)."""
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token

    @property
    def inference_time(self) -> float | None:
        """scheduled -> last token (prefill plus decode)."""
        if self.scheduled is None or self.last_token is None:
            return None
        return self.last_token - self.scheduled


class RequestOutputDelta(TokenColumns, frozen=True, kw_only=True):
    """New results of one request since its previous delta: the per-token columns of its new
    tokens (`TokenColumns`: token_ids, exit_depths, logprobs, top_logprobs) and the rest.

    text: the newly decoded text (special tokens skipped; may be empty while a multi-byte
      character is incomplete; a matched stop string and anything after it are never included).
      Engines that do not detokenize leave it empty.

    exit_depths[i]: loops the hidden state that produced token i went through. Token 0 comes from
      prefill and has the full model depth, except under `SamplingParams.score_at_exit_depth`:
      then the last prompt position ran as decoding would, and token 0 has its exit depth.
    logprobs / top_logprobs: aligned with token_ids when the request asked for logprobs.
    prompt_logprobs / prompt_token_ranks / prompt_top_logprobs: with
      `SamplingParams.prompt_logprobs`, on the delta that carries token 0: one entry per prompt
      token, None for the first (nothing predicts it), as OpenAI and vLLM report them (0.1.10).
    prompt_exit_depths: with `SamplingParams.score_at_exit_depth`, on the same delta: per prompt
      token, the loops of the state that scored it (position i - 1's exit depth under the
      request's exit rule), None for the first; None when the prompt is scored at full depth
      or not at all (0.1.11).
    resolved_seed: the seed actually used (differs from the request when it asked for None).
    kv_target: PD decode instance only: where the prefill instance must write this request's
      KV, on the first delta after the request was admitted (no tokens yet).
    timings: engine-side timestamps, on the final delta only (None elsewhere, and from engines
      that do not record them).
    """

    request_id: str
    text: str = ""
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_token_ranks: tuple[int | None, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    prompt_exit_depths: tuple[int | None, ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    resolved_seed: int | None = None
    error: str | None = None
    timings: RequestTimings | None = None
    kv_target: HandoffTarget | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """Counters and gauges of one engine (monotonic counters unless noted as gauges), and how
    it executes (fixed at construction).

    attention_backend: the selected attention backend ("" from engines that do not say).
    decode_cuda_graphs: decode ticks replay captured CUDA graphs.
    decode_eager_reason: why they run eagerly instead ("" while graphs run), e.g. "not
      requested", no CUDA device, or an attention backend that cannot be captured.
    spec_*: self-speculative decoding counters (0.1.7; `SpeculationCounts`): rounds that
      drafted, draft tokens, accepted tokens, accepted drafts per position (length K).
    """

    running_requests: int = 0  # gauge
    waiting_requests: int = 0  # gauge
    kv_blocks_total: int = 0  # gauge
    kv_blocks_used: int = 0  # gauge
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_loops: int = 0  # recurrent loops run for generated tokens (token 0 excluded)
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0
    resumptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    attention_backend: str = ""
    decode_cuda_graphs: bool = False
    decode_eager_reason: str = ""
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any draft)."""
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a drafting round emits on average: 1 + accepted / drafts (vLLM's mean
        acceptance length; None before any draft)."""
        if not self.spec_drafts:
            return None
        return 1.0 + self.spec_accepted_tokens / self.spec_drafts


class ModelInfo(msgspec.Struct, frozen=True):
    """What a frontend needs to know about the served model. (0.1.8) weight_dtype: the stack's
    projections ("bfloat16", "float8_e4m3fn", ...); kv_cache_dtype; kv_capacity_tokens: tokens
    the KV pool holds at full depth (empty / 0 where unknown, e.g. a PD coordinator).
    (0.3.0) family: the model family's name ("ouro"); exit_signal: its `ExitSignal` value
    ("gate" / "none"; empty where unknown), which decides the server's default threshold.
    num_loops is the model depth: the most loops a request may ask (the engine's cap,
    `max_model_loops`; KV is sized for it). (0.3.2) default_loops: the loops a request that
    omits max_loops runs (the checkpoint's count; 0 where unknown: then num_loops)."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    num_loops: int
    eos_token_ids: tuple[int, ...]
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    kv_capacity_tokens: int = 0
    family: str = ""
    exit_signal: str = ""
    default_loops: int = 0


__all__ = [
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "ModelInfo",
    "RequestOutputDelta",
    "RequestTimings",
    "SamplingParams",
]
