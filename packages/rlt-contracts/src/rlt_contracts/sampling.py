"""`SamplingParams`: per-request decoding and loop-depth settings, validated on construction."""

from __future__ import annotations

import math

import msgspec

from rlt_contracts.errors import InvalidRequestError
from rlt_contracts.structured import StructuredOutput

MAX_SEED = 2**63
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (the OpenAI API's cap)
LOGIT_BIAS_LIMIT = 100.0  # |bias| bound, as in the OpenAI API
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| bound (OpenAI, vLLM)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one request is decoded. Immutable; every field is validated when the object is built.

    Token fields:
      max_tokens: number of tokens to generate (>= 1), including token 0 produced by prefill.
      temperature: 0 means greedy (argmax); > 0 scales logits before sampling. Default 0,
        as `rlt generate`'s; an HTTP request that omits it gets 1.0, OpenAI's
        (docs/configuration.md, "Defaults by entry point").
      top_p: nucleus mass in (0, 1]; 1 keeps the whole distribution.
      top_k: -1 keeps every token; k >= 1 keeps the k most likely.
      seed: seed of this request's private random stream (default 0); None draws one from OS
        entropy at admission (the resolved seed is reported back). The stream never depends
        on other requests in the batch.
      stop: strings that end generation; the matched string is not included in the text
        (unless `include_stop_str_in_output`).
      stop_token_ids: token ids that end generation with finish reason "stop", even if
        `ignore_eos` is set.
      ignore_eos: keep generating past the model's end-of-sequence token.
      logprobs: None for no log-probabilities; n >= 0 returns the chosen token's log-probability
        plus the n most likely alternatives (at most 20). Always of the RAW model distribution:
        before penalties, logit_bias, min_tokens, temperature and every filter.
      prompt_logprobs: None, or n >= 0: the log-probability of every prompt token after the
        first under the model at full depth (each position's state after all loops, as prefill
        computes it, equal to the Hugging Face forward), plus the n most likely alternatives
        at each position (at most 20). Such a prompt reuses only cached pages that carry
        scores for it (a scored prompt's, with at least n alternatives; 0.1.12) and computes
        the rest eagerly (no prefill CUDA graph).
      score_at_exit_depth: with prompt_logprobs only (else InvalidRequestError): score every
        prompt position at the loop where this request's exit rule fires (the loop fields
        below and the engine's exit policy), not at full depth, as a decode that is fed the
        prompt token by token from position 0 would: each position stops at its exit depth and
        later positions read its KV as decoding leaves it (KV layout semantics). Token 0 then
        comes from the last prompt position's exit state (0.1.11). Such a prompt's pages hold
        decode KV, not prefill's: they are published under a salt naming the exit rule, so
        only prompts scored under the same rule reuse them (0.1.12).

    Logits adjustments and filters (vLLM's names, ranges and semantics; greedy rows get the
    adjustments too, before their argmax). Order, as in vLLM's V1 sampler: min_tokens mask,
    logit_bias, repetition, frequency and presence penalties on the raw logits (fp32), then
    temperature, then min_p, then top-k / top-p.
      presence_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in
        the output so far (token 0 included; prompt tokens do not count).
      frequency_penalty: in [-2, 2]; times the token's number of occurrences in the output so
        far, subtracted from its logit.
      repetition_penalty: > 0; the logit of every token that occurs in the prompt or the output
        so far is divided by it if positive, multiplied by it otherwise (1 disables).
      min_p: in [0, 1]; after temperature, tokens whose probability is below min_p times the
        most likely token's are dropped (0 disables).
      min_tokens: in [0, max_tokens]; while fewer than this many tokens were generated, the
        stop token ids (`stop_token_ids` and EOS, even with `ignore_eos`: vLLM's
        all_stop_token_ids) cannot be sampled, and
        stop strings are not checked in the text of those first tokens.
      logit_bias: {token id: bias}, at most 300 entries, each bias in [-100, 100], added to the
        token's logit; ids must be in the vocabulary (checked at admission). None or {} for
        none. Stored as a private dict copy; treat it as read-only.

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
      min_loops: a token never exits before this many loops (>= 1); None (0.3.0 default): the
        model's own (`resolve_min_loops`: DEFAULT_GATE_MIN_LOOPS for a family with an exit
        gate, 1 otherwise), never above max_loops.
      max_loops: a token always exits at this many loops, 1 up to the model depth (the
        engine's loop cap, `max_model_loops`); None (0.3.2): the model's default depth
        (the checkpoint's loop count; `resolve_max_loops`).
      exit_threshold: exit after loop k once 1 - prod_{j<=k}(1 - sigmoid(gate_j)) >= threshold,
        in [0, 1]; 1.0 means a fixed depth of `max_loops` (adaptive exit disabled). Default
        1.0: in Python a gated model exits early only when asked; `rlt generate` and the
        servers default to 0.5 for such a model (`--exit-threshold`).
      priority: admission priority for the "priority" scheduling policy; lower runs first.

    Structured output:
      structured_output: None, or the grammar the output must follow (JSON schema, any JSON
        object, regex or choice; `rlt_contracts.structured`). Such a request makes at most one
        token per engine step; it finishes with "stop" when the grammar is complete.
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
    prompt_logprobs: int | None = None
    score_at_exit_depth: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float = 1.0
    priority: int = 0
    structured_output: StructuredOutput | None = None

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
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None:
                _check_int(name, count, low=0)
                if count > MAX_TOP_LOGPROBS:
                    raise InvalidRequestError(
                        name, f"at most {MAX_TOP_LOGPROBS} alternatives, got {count}"
                    )
        if not isinstance(self.score_at_exit_depth, bool):
            raise InvalidRequestError("score_at_exit_depth", "must be a boolean")
        if self.score_at_exit_depth and self.prompt_logprobs is None:
            raise InvalidRequestError(
                "score_at_exit_depth", "only applies to a scored prompt: set prompt_logprobs too"
            )
        self._check_logits_adjustments()
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, "must be a boolean")
        if self.min_loops is not None:
            _check_int("min_loops", self.min_loops, low=1)
        if self.max_loops is not None:
            _check_int("max_loops", self.max_loops, low=1)
            if self.min_loops is not None and self.max_loops < self.min_loops:
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
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise InvalidRequestError("structured_output", "must be a StructuredOutput")

    def _check_logits_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.logit_bias is not None:
            msgspec.structs.force_setattr(self, "logit_bias", _checked_logit_bias(self.logit_bias))

    @property
    def penalized(self) -> bool:
        """Some repetition, frequency or presence penalty is not neutral."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Some step before temperature (penalties, logit_bias, min_tokens) changes logits."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """True when decoding is a deterministic argmax (no random stream is consumed)."""
        return self.temperature == 0.0

    @property
    def adaptive_exit(self) -> bool:
        """True when the exit gate may end a token before `max_loops`."""
        return self.exit_threshold < 1.0

    def resolve_max_loops(self, model_depth: int, default: int | None = None) -> int:
        """The loops this request's prompt and tokens run at most, on a model of `model_depth`
        loops (the engine's cap, `max_model_loops`); raises InvalidRequestError if out of range.

        An unset `max_loops` is `default` (0.3.2: the model's default depth, e.g. the
        checkpoint's 2 loops under a cap of 4; None: `model_depth`), raised to `min_loops`
        when that is larger, so the bounds stay ordered."""
        cap = f"the model depth ({model_depth}: the engine's loop cap, --max-model-loops)"
        if self.min_loops is not None and self.min_loops > model_depth:
            raise InvalidRequestError("min_loops", f"must be <= {cap}, got {self.min_loops}")
        if self.max_loops is None:
            resolved = model_depth if default is None else default
            return max(resolved, self.min_loops or 1)
        if self.max_loops > model_depth:
            raise InvalidRequestError("max_loops", f"must be <= {cap}, got {self.max_loops}")
        return self.max_loops

    def resolve_min_loops(self, max_loops: int, default: int) -> int:
        """The first loop after which a token may exit: min_loops, or when unset the model's
        `default` (DEFAULT_GATE_MIN_LOOPS for a gated family, 1 otherwise), at most
        `max_loops` (the resolved cap)."""
        return self.min_loops if self.min_loops is not None else min(default, max_loops)


class SamplingRow(msgspec.Struct, frozen=True, array_like=True):
    """One logits row to sample: the request's parameters (seed resolved) and the index of the
    output token being sampled, which is the position in the request's random stream.

    The token history the logits adjustments read (needed only when `params` uses them):
      prompt_token_ids: the prompt (repetition_penalty).
      output_token_ids: the outputs so far, exactly `output_index` of them (penalties).
      stop_token_ids: the ids min_tokens keeps from being sampled: the request's stop ids and
        the model's EOS ids, even under ignore_eos (vLLM's all_stop_token_ids); None means
        `params.stop_token_ids`.
    """

    params: SamplingParams
    output_index: int
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None


def _check_int(field: str, value: object, *, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(field, f"must be >= {low}, got {value}")


def _checked_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """A private copy of a valid logit_bias ({} becomes None), or InvalidRequestError."""
    if not isinstance(logit_bias, dict):
        raise InvalidRequestError("logit_bias", "must be a mapping of token id to bias")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}"
        )
    checked = {}
    for token_id, bias in logit_bias.items():
        _check_int("logit_bias", token_id, low=0)
        _check_float("logit_bias", bias)
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(
                "logit_bias", f"bias of token {token_id} must be in [-100, 100], got {bias}"
            )
        checked[token_id] = float(bias)
    return checked or None


def _check_float(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be finite, got {value}")
