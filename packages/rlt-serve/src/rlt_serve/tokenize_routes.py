"""POST /tokenize and POST /detokenize (vLLM's shapes), with the served model's tokenizer.

/tokenize gives exactly the token ids the generation endpoints would use: a `prompt` is
tokenized as /v1/completions does (no special tokens added unless `add_special_tokens`), and
`messages` are rendered with the chat template as /v1/chat/completions does (same options).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from rlt_serve.chat_template import chat_prompt
from rlt_serve.context import ServerContext
from rlt_serve.errors import invalid
from rlt_serve.params import check_model
from rlt_serve.request_schemas import ChatMessage, RequestModel
from rlt_serve.unicode_input import check_valid_unicode


class TokenizeRequest(RequestModel):
    """Either `prompt` or `messages`."""

    model: str | None = Field(None, description="The served model name; omitted means it.")
    prompt: str | None = Field(None, description="Text, tokenized as /v1/completions does.")
    messages: list[ChatMessage] | None = Field(
        None, description="A chat, rendered and tokenized as /v1/chat/completions does."
    )
    add_special_tokens: bool | None = Field(
        False, description="prompt only: add the tokenizer's special tokens (e.g. BOS)."
    )
    add_generation_prompt: bool | None = Field(True, description="messages only.")
    continue_final_message: bool | None = Field(False, description="messages only.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages only.")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, description="The served model name; omitted means it.")
    tokens: list[int] = Field(description="Token ids, each in [0, vocab_size).")


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(
    app: FastAPI, ctx: ServerContext, *, errors: dict[int | str, dict[str, Any]]
) -> None:
    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=errors,
        tags=["tokenizer"],
        summary="Tokenize a prompt or a chat",
    )
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_valid_unicode(body)
        check_model(body.model, ctx.served_model_name)
        if body.prompt is None and body.messages is None:
            raise invalid("prompt", "prompt: give either prompt or messages")
        if body.prompt is not None and body.messages is not None:
            raise invalid("messages", "messages: give either prompt or messages, not both")
        if body.messages is not None:
            tokens = chat_prompt(body, ctx.tokenizer, ctx.chat_template)
        else:
            try:
                tokens = list(
                    ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
                )
            except Exception as exc:  # noqa: BLE001 - text the tokenizer refuses
                raise invalid("prompt", f"prompt: the tokenizer cannot encode it: {exc}") from exc
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=ctx.model_info.max_model_len
        )

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=errors,
        tags=["tokenizer"],
        summary="Turn token ids back into text",
    )
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model, ctx.served_model_name)
        vocab_size = ctx.model_info.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise invalid(
                    "tokens",
                    f"tokens[{i}]: token id {token} is not in the vocabulary [0, {vocab_size})",
                )
        return DetokenizeResponse(
            prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)
        )
