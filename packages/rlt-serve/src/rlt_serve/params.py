"""Request fields -> `SamplingParams`, and the checks every generation request shares."""

from __future__ import annotations

from typing import Annotated

import msgspec
from rlt_contracts import (
    DEFAULT_GATE_EXIT_THRESHOLD,
    ConfigurationError,
    ExitSignal,
    InvalidRequestError,
    ModelInfo,
    Option,
    SamplingParams,
)

from rlt_serve.errors import APIError, invalid
from rlt_serve.request_schemas import ChatCompletionRequest, CompletionRequest, _CommonOpenAIFields
from rlt_serve.structured_output import structured_output_of


class LoopDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """loops (of requests that leave them out)

    Each field is an option (rlt_contracts.options, the flags of rlt_serve.option_flags).
    min_loops None means the model's own (`SamplingParams.resolve_min_loops`); max_loops None
    means the model's default depth (the checkpoint's count, which the engine applies; at most
    the model depth, the engine's cap --max-model-loops); exit_threshold None means the
    model's own default (`for_model`): the command line's, where Python keeps fixed depth."""

    min_loops: Annotated[
        int | None,
        Option("loops every token runs before it may exit (default: the model family's own)"),
    ] = None
    max_loops: Annotated[
        int | None,
        Option(
            "loops after which every token exits (default: the checkpoint's loop count, at "
            "most --max-model-loops)"
        ),
    ] = None
    exit_threshold: Annotated[
        float | None,
        Option(
            "exit once the gate's cumulative probability reaches this (1.0 = fixed depth); "
            f"default: {DEFAULT_GATE_EXIT_THRESHOLD} for a model with an exit gate (1.0 in "
            "Python's SamplingParams), the fixed depth for one without an exit signal",
            flag_default=None,
        ),
    ] = 1.0

    def for_model(self, info: ModelInfo) -> LoopDefaults:
        """These defaults made concrete for the served model, checked against it (else every
        request would fail): an unset threshold is DEFAULT_GATE_EXIT_THRESHOLD for a model
        with an exit gate and the fixed depth (1.0) otherwise; an adaptive threshold for a
        model without an exit signal is a `ConfigurationError`."""
        threshold = self.exit_threshold
        gated = info.exit_signal in ("", ExitSignal.GATE)  # "" : a peer that does not say
        if threshold is None:
            threshold = DEFAULT_GATE_EXIT_THRESHOLD if gated else 1.0
        elif threshold < 1.0 and not gated:
            raise ConfigurationError(
                "exit_threshold",
                f"loop default: the {info.family or 'served'} model has no exit signal, so an "
                f"exit threshold ({threshold}) cannot apply; leave it unset",
            )
        try:
            SamplingParams(
                min_loops=self.min_loops, max_loops=self.max_loops, exit_threshold=threshold
            ).resolve_max_loops(info.num_loops, info.default_loops or None)
        except InvalidRequestError as exc:
            raise ConfigurationError(exc.field, f"loop default: {exc.message}") from None
        return msgspec.structs.replace(self, exit_threshold=threshold)


def check_model(requested: str | None, served_model_name: str) -> None:
    if requested is not None and requested != served_model_name:
        raise APIError(
            404,
            f"The model '{requested}' does not exist; this server serves '{served_model_name}'",
            param="model",
            code="model_not_found",
        )


MAX_SEQUENCES_PER_PROMPT = 128  # bound on n and best_of


def check_supported(request: _CommonOpenAIFields) -> None:
    """400 for OpenAI features we accept only at their neutral value, and out-of-range n and
    best_of."""
    check_sequences(request)
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "stream_options: only allowed with stream=true")
    if isinstance(request, CompletionRequest):
        if request.suffix is not None:
            raise invalid("suffix", "suffix: not supported")
    if isinstance(request, ChatCompletionRequest):
        if request.tools:
            raise invalid("tools", "tools: tool calling is not supported")
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs", "top_logprobs: requires logprobs=true")
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise invalid(
                "max_completion_tokens",
                "max_completion_tokens: give either max_tokens or max_completion_tokens",
            )


def check_sequences(request: CompletionRequest | ChatCompletionRequest) -> None:
    """n in [1, 128]; best_of (None means n) in [n, 128], and equal to n when streaming (the
    best sequences are known only at the end; vLLM refuses it too)."""
    limit = MAX_SEQUENCES_PER_PROMPT
    if not 1 <= request.n <= limit:
        raise invalid("n", f"n: must be in [1, {limit}], got {request.n}")
    best_of = request.best_of
    if best_of is None:
        return
    if not request.n <= best_of <= limit:
        raise invalid("best_of", f"best_of: must be in [n={request.n}, {limit}], got {best_of}")
    if best_of > request.n and request.stream:
        raise invalid("best_of", "best_of: best_of > n is not supported with stream=true")


def logit_bias_of(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys, i.e. strings) with int keys; a key
    that is not a decimal token id is a 400 naming logit_bias. Ranges: SamplingParams."""
    if not logit_bias:
        return None
    converted = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid("logit_bias", f"logit_bias: {key!r} is not a token id")
        converted[int(key)] = bias
    return converted


def sampling_params(
    request: _CommonOpenAIFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop_token_ids: tuple[int, ...] = (),
    defaults: LoopDefaults,
    default_seed: int | None = None,
    field_names: dict[str, str] | None = None,
) -> SamplingParams:
    """Build and validate the engine's parameters; a bad value is a 400 naming its field.
    `default_seed` (the server's --seed) seeds a request that gives no seed."""
    stop = request.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    min_loops, max_loops = request.min_loops, request.max_loops
    # A bound the request gives wins over the other bound's server default.
    if min_loops is None:
        min_loops = defaults.min_loops
        if min_loops is not None and max_loops is not None and max_loops >= 1:
            min_loops = min(min_loops, max_loops)
    if max_loops is None and defaults.max_loops is not None:
        max_loops = max(defaults.max_loops, min_loops or 1)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=-1 if request.top_k == 0 else request.top_k,
            seed=request.seed if request.seed is not None else default_seed,
            stop=stops,
            stop_token_ids=tuple(request.stop_token_ids or ()) + extra_stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            score_at_exit_depth=request.score_at_exit_depth,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            min_loops=min_loops,
            max_loops=max_loops,
            exit_threshold=(
                request.exit_threshold
                if request.exit_threshold is not None
                else defaults.exit_threshold
            ),
            priority=request.priority,
            structured_output=structured_output_of(request),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            min_p=request.min_p,
            min_tokens=request.min_tokens,
            logit_bias=logit_bias_of(request.logit_bias),
        )
    except InvalidRequestError as exc:
        param = (field_names or {}).get(exc.field, exc.field)
        raise invalid(param, f"{param}: {exc.message}") from exc
