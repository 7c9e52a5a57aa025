"""`SamplingParams`: per-request decoding and loop-depth settings, validated on construction."""

from __future__ import annotations

import math

import msgspec

from rlt_contracts.errors import InvalidRequestError

MAX_SEED = 2**63
MAX_TOP_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one request is decoded. Immutable; every field is validated when the object is built.

    Token fields:
      max_tokens: number of tokens to generate (>= 1), including token 0 produced by prefill.
      temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
      top_p: nucleus mass in (0, 1]; 1 keeps the whole distribution.
      top_k: -1 keeps every token; k >= 1 keeps the k most likely.
      seed: seed of this request's private random stream; None draws one from OS entropy at
        admission (the resolved seed is reported back). The stream never depends on other
        requests in the batch.
      stop: strings that end generation; the matched string is not included in the text
        (unless `include_stop_str_in_output`).
      stop_token_ids: token ids that end generation with finish reason "stop", even if
        `ignore_eos` is set.
      ignore_eos: keep generating past the model's end-of-sequence token.
      logprobs: None for no log-probabilities; n >= 0 returns the chosen token's log-probability
        plus the n most likely alternatives (at most 20).

    Text fields (how the engine detokenizes; vLLM's names and defaults):
      include_stop_str_in_output: False: the text ends before a matched stop string, and the
        text of a stop token (EOS or a `stop_token_ids` id) is left out; True: both are kept
        (the text ends right after the stop string; later text is cut).
      skip_special_tokens: leave the tokenizer's special tokens (e.g. `<|im_end|>`) out of
        the text.
      spaces_between_special_tokens: with `skip_special_tokens=False`, False writes an added
        token that follows another added token as its bare content, without the separator the
        tokenizer's decoder may put before it (vLLM's fast-tokenizer rule); True (default)
        keeps the decoder's text. No effect while special tokens are skipped.

    Loop fields (recurrent looped transformers):
      min_loops: a token never exits before this many loops (>= 1).
      max_loops: a token always exits at this many loops; None means the model's depth.
      exit_threshold: exit after loop k once 1 - prod_{j<=k}(1 - sigmoid(gate_j)) >= threshold,
        in [0, 1]; 1.0 means a fixed depth of `max_loops` (adaptive exit disabled).
      priority: admission priority for the "priority" scheduling policy; lower runs first.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_loops: int = 2
    max_loops: int | None = None
    exit_threshold: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise InvalidRequestError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= MAX_SEED:
                raise InvalidRequestError("seed", f"must be < 2**63, got {self.seed}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    "logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}"
                )
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, "must be a boolean")
        _check_int("min_loops", self.min_loops, low=1)
        if self.max_loops is not None:
            _check_int("max_loops", self.max_loops, low=1)
            if self.max_loops < self.min_loops:
                raise InvalidRequestError(
                    "max_loops",
                    f"must be >= min_loops ({self.min_loops}), got {self.max_loops}",
                )
        _check_float("exit_threshold", self.exit_threshold)
        if not 0.0 <= self.exit_threshold <= 1.0:
            raise InvalidRequestError(
                "exit_threshold", f"must be in [0, 1], got {self.exit_threshold}"
            )
        _check_int("priority", self.priority)

    @property
    def greedy(self) -> bool:
        """True when decoding is a deterministic argmax (no random stream is consumed)."""
        return self.temperature == 0.0

    @property
    def adaptive_exit(self) -> bool:
        """True when the exit gate may end a token before `max_loops`."""
        return self.exit_threshold < 1.0

    def resolve_max_loops(self, model_depth: int) -> int:
        """Effective loop cap for a model with `model_depth` loops; raises if out of range."""
        if self.min_loops > model_depth:
            raise InvalidRequestError(
                "min_loops", f"must be <= the model depth ({model_depth}), got {self.min_loops}"
            )
        if self.max_loops is None:
            return model_depth
        if self.max_loops > model_depth:
            raise InvalidRequestError(
                "max_loops", f"must be <= the model depth ({model_depth}), got {self.max_loops}"
            )
        return self.max_loops


class SamplingRow(msgspec.Struct, frozen=True, array_like=True):
    """One logits row to sample: the request's parameters (seed resolved) and the index of the
    output token being sampled, which is the position in the request's random stream."""

    params: SamplingParams
    output_index: int


def _check_int(field: str, value: object, *, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(field, f"must be >= {low}, got {value}")


def _check_float(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be finite, got {value}")
