"""Response bodies of the OpenAI-compatible API (and of /v1/models, /health and errors), as
pydantic models (requests: request_schemas.py).

FastAPI publishes these in its OpenAPI schema, so the schema is exactly what the server returns.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer

FinishReasonName = Literal["stop", "length", "abort"]


class TokenFields(BaseModel):
    """rlt's per-token fields of a choice, aligned with its generated tokens (in a stream: with
    this chunk's). Declared once, here: `token_fields` fills every one of them by name from the
    engine's per-token columns (`rlt_contracts.TokenColumns`), so a per-token column reaches
    every completion and chat choice and chunk by adding its field to this class."""

    exit_depths: list[int] = Field(
        description="rlt: loops each generated token's hidden state went through (token 0 "
        "comes from prefill at the full depth). In a stream: those of this chunk's tokens."
    )

    @model_serializer(mode="wrap")
    def _openai_fields_first(self, handler):
        """A choice's own (OpenAI) fields first, then these extensions (as before 0.2.0)."""
        body = handler(self)
        extensions = TokenFields.model_fields
        return {k: v for k, v in body.items() if k not in extensions} | {
            k: body[k] for k in extensions if k in body
        }


def token_fields(tokens: object, start: int = 0, end: int | None = None) -> dict[str, object]:
    """`TokenFields`' values over tokens [start, end) of a delta or a choice's `TokenLog`."""
    return {
        name: None if (values := getattr(tokens, name)) is None else list(values[start:end])
        for name in TokenFields.model_fields
    }


class LoopUsage(BaseModel):
    """rlt: recurrent-loop accounting of one response (all choices)."""

    total_loops: int = Field(description="Sum of the exit depths of every generated token.")
    mean_loops_per_token: float = Field(
        description="Mean exit depth of the decoded tokens (token 0 comes from prefill at the "
        "full depth and is excluded; 0 when there is none)."
    )
    model_depth: int = Field(description="Loops of the model (the most a token can take).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    loops: LoopUsage | None = Field(None, description="rlt extension.")


class PromptLogprob(BaseModel):
    """vLLM's entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    """Per token of the choice's text. With echo=true the prompt's tokens come first with
    their log-probabilities (null for the first prompt token), at full depth unless the
    request set score_at_exit_depth."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    prompt_exit_depths: list[int | None] | None = Field(
        None,
        description="rlt, only with echo and score_at_exit_depth (absent otherwise): per "
        "prompt token (the first len(prompt) entries above), the loops of the state that "
        "scored it, null for the first.",
    )

    @model_serializer(mode="wrap")
    def _drop_absent_depths(self, handler):
        body = handler(self)
        if body.get("prompt_exit_depths", 0) is None:
            del body["prompt_exit_depths"]
        return body


class CompletionChoice(TokenFields):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None
    token_ids: list[int] | None = Field(None, description="rlt: with return_token_ids=true.")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None,
        description="vLLM: with prompt_logprobs=N, per prompt token (null for the first) the "
        "token and its N most likely alternatives (at full depth unless score_at_exit_depth), "
        "keyed by token id.",
    )
    prompt_exit_depths: list[int | None] | None = Field(
        None,
        description="rlt: with score_at_exit_depth, per prompt token (null for the first) the "
        "loops of the state that scored it (its previous position's exit depth).",
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(TokenFields):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None
    token_ids: list[int] | None = Field(None, description="rlt: with return_token_ids=true.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM: with prompt_logprobs=N, the rendered prompt's scores."
    )
    prompt_exit_depths: list[int | None] | None = Field(
        None,
        description="rlt: with score_at_exit_depth, per token of the rendered prompt (null for "
        "the first) the loops of the state that scored it.",
    )


class ChatDelta(BaseModel):
    """Only the fields a chunk sets are sent (the role in the first chunk, then content)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(TokenFields):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None
    token_ids: list[int] | None = Field(None, description="rlt: with return_token_ids=true.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rlt"
    max_model_len: int = Field(description="rlt: context length in tokens.")
    num_loops: int = Field(
        description="rlt: model depth, the loops a request may ask at most (the engine's cap)."
    )
    default_loops: int | None = Field(
        None, description="rlt: the loops a request that omits max_loops runs."
    )
    weight_dtype: str | None = Field(
        None, description="rlt: dtype of the shared stack's projections (e.g. float8_e4m3fn)."
    )
    kv_cache_dtype: str | None = Field(None, description="rlt: dtype of the KV cache.")
    kv_capacity_tokens: int | None = Field(
        None, description="rlt: tokens the KV pool holds at full depth."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(None, description="The offending request field, if any.")
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "shutting_down", "dead"]
    detail: str | None = None
