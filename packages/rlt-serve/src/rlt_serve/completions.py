"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from rlt_contracts import COLUMNS, RequestOutputDelta, TokenColumns

from rlt_serve.context import ServerContext, new_id
from rlt_serve.generation import Choice, Generation
from rlt_serve.params import check_model, check_supported, sampling_params
from rlt_serve.prompt_scores import (
    echo_logprobs,
    prompt_exit_depths,
    prompt_scores_wanted,
    vllm_prompt_logprobs,
)
from rlt_serve.prompts import check_max_tokens, check_prompt, completion_prompts, prompt_texts
from rlt_serve.request_schemas import CompletionRequest
from rlt_serve.response_schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    LoopUsage,
    Usage,
    token_fields,
)
from rlt_serve.streaming import stream_generation
from rlt_serve.unicode_input import check_valid_unicode

PATH = "/v1/completions"


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    check_valid_unicode(body)
    check_model(body.model, ctx.served_model_name)
    check_supported(body)
    info = ctx.model_info
    prompts = completion_prompts(body.prompt, ctx.tokenizer)
    scoring = prompt_scores_wanted(body)
    # max_tokens 0 scores only: the engine's token 0 is left out of the response
    scoring_only = body.max_tokens == 0
    max_tokens = 1 if scoring_only else body.max_tokens
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        check_prompt(prompt, info, param=param)
        check_max_tokens(len(prompt), max_tokens, info, param="max_tokens")
    want_logprobs = body.logprobs is not None
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=scoring,
        defaults=ctx.loop_defaults,
        default_seed=ctx.default_seed,
        field_names={"prompt_logprobs": "prompt_logprobs" if body.prompt_logprobs else "logprobs"},
    )
    echoed = prompt_texts(body.prompt, prompts, ctx.tokenizer) if body.echo else None
    response_id = new_id("cmpl")
    created = int(time.time())
    generation = Generation(
        ctx.client,
        response_id=response_id,
        prompts=prompts,
        sampling=params,
        metrics=ctx.metrics,
        path=PATH,
        request=request,
        n=body.n,
        best_of=body.best_of,
        final_only=not body.stream,
    )
    n = body.n
    want_ids = body.return_token_ids

    if not body.stream:
        failure = await generation.collect()
        if failure is not None:
            return failure.response()
        choices = []
        for c in generation.final_choices():
            prefix = echoed[c.prompt_index] if echoed is not None else ""
            prompt = prompts[c.prompt_index]
            kept = 0 if scoring_only else len(c.token_ids)
            logprobs = None
            if want_logprobs:
                logprobs = _logprobs(
                    ctx, c.token_ids[:kept], c.logprobs[:kept], c.top_logprobs, len(prefix)
                )
                if echoed is not None:
                    logprobs = _joined(echo_logprobs(ctx, prompt, c), logprobs)
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=prefix + (c.text if kept else ""),
                    logprobs=logprobs,
                    finish_reason=_finish_reason(c, scoring_only),
                    **token_fields(c.tokens, 0, kept),
                    token_ids=c.token_ids[:kept] if want_ids else None,
                    prompt_logprobs=(
                        vllm_prompt_logprobs(ctx, prompt, c)
                        if body.prompt_logprobs is not None
                        else None
                    ),
                    prompt_exit_depths=prompt_exit_depths(c),
                )
            )
        response = CompletionResponse(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            choices=choices,
            usage=_usage(generation, info.num_loops, scoring_only),
        )
        return JSONResponse(response.model_dump(mode="json"))

    await generation.__aenter__()
    # streamed choices are every sequence (best_of == n): index = prompt_index * n + i
    text_offsets = [
        len(echoed[i // n]) if echoed is not None else 0 for i in range(len(prompts) * n)
    ]
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def response_of(*choices: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            choices=list(choices),
            usage=usage,
        )

    opening = [
        response_of(
            CompletionChoice(
                index=p * n + i,
                text=text,
                logprobs=None,  # the prompt's come with the first generated token's
                finish_reason=None,
                **token_fields(TokenColumns()),
                token_ids=[] if want_ids else None,
            )
        )
        for p, text in enumerate(echoed or ())
        for i in range(n)
    ]

    def chunk(choice: Choice, delta: RequestOutputDelta) -> Iterable[CompletionResponse]:
        if scoring_only:  # the engine's token 0 is not part of the response
            delta = _without_tokens(delta)
        prompt = prompts[choice.prompt_index]
        logprobs = None
        if want_logprobs and delta.logprobs is not None:
            logprobs = _logprobs(
                ctx,
                delta.token_ids,
                delta.logprobs,
                delta.top_logprobs or (),
                text_offsets[choice.index],
            )
            text_offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
            if echoed is not None and delta.prompt_logprobs is not None:
                logprobs = _joined(echo_logprobs(ctx, prompt, choice), logprobs)
        scored = body.prompt_logprobs is not None and delta.prompt_logprobs is not None
        yield response_of(
            CompletionChoice(
                index=choice.index,
                text=delta.text,
                logprobs=logprobs,
                finish_reason=(_finish_reason(choice, scoring_only) if delta.finished else None),
                **token_fields(delta),
                token_ids=list(delta.token_ids) if want_ids else None,
                prompt_logprobs=vllm_prompt_logprobs(ctx, prompt, choice) if scored else None,
                prompt_exit_depths=(
                    prompt_exit_depths(choice) if delta.prompt_logprobs is not None else None
                ),
            )
        )

    def closing() -> Iterable[CompletionResponse]:
        if include_usage:
            yield response_of(usage=_usage(generation, info.num_loops, scoring_only))

    return stream_generation(generation, opening=opening, chunks=chunk, closing=closing)


def _logprobs(
    ctx: ServerContext,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
    first_offset: int,
) -> CompletionLogprobs:
    """Logprobs of generated tokens; each `top_logprobs` entry holds the requested
    alternatives plus the sampled token (as OpenAI and vLLM do), so logprobs=0 gives just the
    sampled token. Entries are keyed by token text: when two tokens share a text (e.g. the
    halves of one UTF-8 character), the sampled token's log-probability is the one kept, so
    `top_logprobs[i][tokens[i]] == token_logprobs[i]` always holds."""
    tokens = [ctx.token_text(t) for t in token_ids]
    top = []
    for i, logprob in enumerate(logprobs):
        alternatives = top_logprobs[i] if i < len(top_logprobs) else ()
        entry = {ctx.token_text(t): lp for t, lp in alternatives}
        entry[tokens[i]] = logprob
        top.append(entry)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=top,
        text_offset=_offsets(tokens, first_offset),
    )


def _usage(generation: Generation, model_depth: int, scoring_only: bool) -> Usage:
    """The generation's usage; scoring only (max_tokens 0) generated nothing it returns."""
    usage = generation.usage(model_depth)
    if not scoring_only:
        return usage
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=0,
        total_tokens=usage.prompt_tokens,
        loops=LoopUsage(total_loops=0, mean_loops_per_token=0.0, model_depth=model_depth),
    )


def _without_tokens(delta: RequestOutputDelta) -> RequestOutputDelta:
    """`delta` without its tokens, text and their logprobs (scoring only)."""
    empty = {name: None if getattr(delta, name) is None else () for name in COLUMNS}
    return msgspec.structs.replace(delta, text="", **empty)


def _finish_reason(choice: Choice, scoring_only: bool) -> str | None:
    """Scoring only: "length" (no token was asked for), unless the request failed."""
    if scoring_only and choice.finish_reason in ("stop", "length"):
        return "length"
    return choice.finish_reason


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
        prompt_exit_depths=first.prompt_exit_depths,  # the echoed prompt's, at exit depth
    )


def _offsets(tokens: Sequence[str], first: int) -> list[int]:
    offsets = []
    for token in tokens:
        offsets.append(first)
        first += len(token)
    return offsets
