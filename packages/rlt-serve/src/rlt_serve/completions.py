"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse
from rlt_contracts import RequestOutputDelta

from rlt_serve.context import ServerContext, new_id
from rlt_serve.generation import Choice, Generation
from rlt_serve.params import check_model, check_supported, sampling_params
from rlt_serve.prompts import check_max_tokens, check_prompt, completion_prompts
from rlt_serve.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from rlt_serve.streaming import stream_generation

PATH = "/v1/completions"


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    check_model(body.model, ctx.served_model_name)
    check_supported(body)
    info = ctx.model_info
    prompts = completion_prompts(body.prompt, ctx.tokenizer)
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        check_prompt(prompt, info, param=param)
        check_max_tokens(len(prompt), body.max_tokens, info, param="max_tokens")
    params = sampling_params(
        body, max_tokens=body.max_tokens, logprobs=body.logprobs, defaults=ctx.loop_defaults
    )
    response_id = new_id("cmpl")
    created = int(time.time())
    generation = Generation(
        ctx.client,
        response_id=response_id,
        prompts=prompts,
        sampling=params,
        metrics=ctx.metrics,
        path=PATH,
    )
    want_ids = body.return_token_ids
    want_logprobs = body.logprobs is not None

    if not body.stream:
        async with generation:
            async with generation.cancel_on_disconnect(request):
                await generation.collect()
        failure = generation.failure()
        if failure is not None:
            return failure.response()
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.text,
                logprobs=_logprobs(ctx, c.token_ids, c.logprobs, c.top_logprobs, 0)
                if want_logprobs
                else None,
                finish_reason=c.finish_reason,
                exit_depths=c.exit_depths,
                token_ids=c.token_ids if want_ids else None,
            )
            for c in generation.choices
        ]
        response = CompletionResponse(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            choices=choices,
            usage=generation.usage(info.num_loops),
        )
        return JSONResponse(response.model_dump(mode="json"))

    await generation.__aenter__()
    text_offsets = [0] * len(prompts)
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def chunk(choice: Choice, delta: RequestOutputDelta) -> Iterable[CompletionResponse]:
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
        yield CompletionResponse(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if delta.finished else None,
                    exit_depths=list(delta.exit_depths),
                    token_ids=list(delta.token_ids) if want_ids else None,
                )
            ],
        )

    def closing() -> Iterable[CompletionResponse]:
        if include_usage:
            yield CompletionResponse(
                id=response_id,
                created=created,
                model=ctx.served_model_name,
                choices=[],
                usage=generation.usage(info.num_loops),
            )

    return stream_generation(request, generation, opening=(), chunks=chunk, closing=closing)


def _logprobs(
    ctx: ServerContext,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
    first_offset: int,
) -> CompletionLogprobs:
    tokens = [ctx.token_text(t) for t in token_ids]
    offsets = []
    offset = first_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [{ctx.token_text(t): lp for t, lp in alternatives} for alternatives in top_logprobs]
    top += [{} for _ in range(len(tokens) - len(top))]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top, text_offset=offsets
    )
