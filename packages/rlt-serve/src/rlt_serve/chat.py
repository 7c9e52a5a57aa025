"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse
from rlt_contracts import RequestOutputDelta, TokenColumns

from rlt_serve.chat_template import chat_prompt, chat_stop_token_ids, message_text
from rlt_serve.context import ServerContext, new_id
from rlt_serve.errors import invalid
from rlt_serve.generation import Choice, Generation
from rlt_serve.params import check_model, check_supported, sampling_params
from rlt_serve.prompt_scores import prompt_exit_depths, vllm_prompt_logprobs
from rlt_serve.prompts import check_max_tokens, check_prompt
from rlt_serve.request_schemas import ChatCompletionRequest
from rlt_serve.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    token_fields,
)
from rlt_serve.streaming import stream_generation
from rlt_serve.unicode_input import check_valid_unicode

PATH = "/v1/chat/completions"


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext):
    check_valid_unicode(body)
    check_model(body.model, ctx.served_model_name)
    check_supported(body)
    info = ctx.model_info
    prompt = chat_prompt(body, ctx.tokenizer, ctx.chat_template)
    echoed = _echoed_text(body)
    check_prompt(prompt, info, param="messages")
    max_tokens_field = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is None:  # what is left of the context
        max_tokens = max(info.max_model_len - len(prompt) + 1, 1)
    check_max_tokens(len(prompt), max_tokens, info, param=max_tokens_field)
    if body.prompt_logprobs is not None and body.stream:
        raise invalid("prompt_logprobs", "prompt_logprobs: not available with stream=true")
    field_names = {"logprobs": "top_logprobs", "max_tokens": max_tokens_field, "prompt": "messages"}
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        extra_stop_token_ids=chat_stop_token_ids(ctx.tokenizer, info.vocab_size),
        defaults=ctx.loop_defaults,
        default_seed=ctx.default_seed,
        field_names=field_names,
    )
    response_id = new_id("chatcmpl")
    created = int(time.time())
    generation = Generation(
        ctx.client,
        response_id=response_id,
        prompts=[prompt],
        sampling=params,
        metrics=ctx.metrics,
        path=PATH,
        request=request,
        field_names=field_names,
        n=body.n,
        best_of=body.best_of,
        final_only=not body.stream,
    )
    want_ids = body.return_token_ids

    if not body.stream:
        failure = await generation.collect()
        if failure is not None:
            return failure.response()
        final = generation.final_choices()
        response = ChatCompletionResponse(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            prompt_logprobs=(
                vllm_prompt_logprobs(ctx, prompt, final[0])
                if body.prompt_logprobs is not None
                else None
            ),
            prompt_exit_depths=prompt_exit_depths(final[0]),
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=AssistantMessage(content=(echoed or "") + choice.text),
                    logprobs=(
                        _logprobs(ctx, choice.token_ids, choice.logprobs, choice.top_logprobs)
                        if body.logprobs
                        else None
                    ),
                    finish_reason=choice.finish_reason,
                    **token_fields(choice.tokens),
                    token_ids=choice.token_ids if want_ids else None,
                )
                for choice in final
            ],
            usage=generation.usage(info.num_loops),
        )
        return JSONResponse(response.model_dump(mode="json"))

    await generation.__aenter__()
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def make_chunk(choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=response_id,
            created=created,
            model=ctx.served_model_name,
            choices=choices,
            usage=usage,
        )

    def opening_chunk(index: int, delta: ChatDelta) -> ChatCompletionChunk:
        return make_chunk(
            [
                ChatChunkChoice(
                    index=index, delta=delta, finish_reason=None, **token_fields(TokenColumns())
                )
            ]
        )

    # per choice (streamed: best_of == n), its role, then the echoed assistant content, before
    # any generated token
    opening = [opening_chunk(i, ChatDelta(role="assistant", content="")) for i in range(body.n)]
    if echoed:
        opening.extend(opening_chunk(i, ChatDelta(content=echoed)) for i in range(body.n))

    def chunk(choice: Choice, delta: RequestOutputDelta) -> Iterable[ChatCompletionChunk]:
        logprobs = None
        if body.logprobs and delta.logprobs is not None:
            logprobs = _logprobs(ctx, delta.token_ids, delta.logprobs, delta.top_logprobs or ())
        yield make_chunk(
            [
                ChatChunkChoice(
                    index=choice.index,
                    delta=ChatDelta(content=delta.text),
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if delta.finished else None,
                    **token_fields(delta),
                    token_ids=list(delta.token_ids) if want_ids else None,
                )
            ]
        )

    def closing() -> Iterable[ChatCompletionChunk]:
        if include_usage:
            yield make_chunk([], usage=generation.usage(info.num_loops))

    return stream_generation(generation, opening=opening, chunks=chunk, closing=closing)


def _echoed_text(body: ChatCompletionRequest) -> str | None:
    """With echo=true and an assistant message last: its content, which the reply begins with
    (as vLLM does); None otherwise."""
    if not body.echo or not body.messages or body.messages[-1].role != "assistant":
        return None
    return message_text(body.messages[-1]) or ""


def _logprobs(
    ctx: ServerContext,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
) -> ChatLogprobs:
    """Each token's `top_logprobs` holds the requested alternatives (most likely first) and,
    when they were asked for (top_logprobs >= 1), the sampled token after them if it is not
    among them, as OpenAI and vLLM do."""

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        sampled = entry(token_id, logprob)
        alternatives = top_logprobs[i] if i < len(top_logprobs) else ()
        top = [entry(t, lp) for t, lp in alternatives]
        if alternatives and all(t != token_id for t, _ in alternatives):
            top.append(sampled)
        content.append(
            TokenLogprob(
                token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes, top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
