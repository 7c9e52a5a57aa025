"""What the engine reports to its frontends: per-request output deltas and engine statistics."""

from __future__ import annotations

import msgspec

from rlt_contracts.requests import FinishReason
from rlt_contracts.sampling import SamplingParams


class EngineRequest(msgspec.Struct, frozen=True):
    """A request as submitted to an `EngineClient`.

    prompt_token_ids: the tokenized prompt (non-empty, every id < the vocabulary size).
    arrival_time: seconds since the epoch (time.time()) when the frontend received it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0


class RequestOutputDelta(msgspec.Struct, frozen=True):
    """New results of one request since its previous delta.

    text: the newly decoded text (special tokens skipped; may be empty while a multi-byte
      character is incomplete; a matched stop string and anything after it are never included).
      Engines that do not detokenize leave it empty.

    exit_depths[i]: loops the hidden state that produced token i went through. Token 0 comes from
      prefill and always has the full model depth.
    logprobs / top_logprobs: aligned with token_ids when the request asked for logprobs.
    resolved_seed: the seed actually used (differs from the request when it asked for None).
    """

    request_id: str
    token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]
    text: str = ""
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    resolved_seed: int | None = None
    error: str | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """Counters and gauges of one engine (monotonic counters unless noted as gauges)."""

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

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


class ModelInfo(msgspec.Struct, frozen=True):
    """What a frontend needs to know about the served model."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    num_loops: int
    eos_token_ids: tuple[int, ...]


__all__ = [
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "ModelInfo",
    "RequestOutputDelta",
    "SamplingParams",
]
