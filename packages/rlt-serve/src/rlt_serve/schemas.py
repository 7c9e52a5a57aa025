"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

FastAPI publishes these in its OpenAPI schema, so the schema is exactly what the server
validates and returns.

Validation policy (see docs/serving.md):
- Types are strict: "5" is not an integer and true is not a number.
- Fields the OpenAI API defines but that change nothing here (user, metadata, store, ...) are
  accepted and ignored. Fields whose non-default value we cannot honour (n > 1, echo,
  logit_bias, penalties, tools, ...) are accepted only at their neutral value; anything else
  answers 400 naming the field.
- Fields nobody defines answer 400 "Unrecognized request argument supplied: NAME".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

FinishReasonName = Literal["stop", "length", "abort"]

_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = Field(
        False, description="Send a last chunk (with empty `choices`) carrying `usage`."
    )


class LoopFields(BaseModel):
    """rlt extensions shared by both endpoints (OpenAI clients pass them via `extra_body`)."""

    model_config = _REQUEST_CONFIG

    min_loops: int | None = Field(
        None,
        description="rlt: a token never exits before this many loops (>= 1). "
        "Default: the server's --min-loops.",
    )
    max_loops: int | None = Field(
        None,
        description="rlt: a token always exits at this many loops (<= the model depth). "
        "Default: the server's --max-loops (the model depth when unset).",
    )
    exit_threshold: float | None = Field(
        None,
        description="rlt: exit once the gate's cumulative exit probability reaches this, "
        "in [0, 1]; 1.0 runs every token to max_loops. Default: the server's --exit-threshold.",
    )
    priority: int = Field(
        0,
        description="rlt: admission priority under the 'priority' scheduling policy "
        "(lower runs first); ignored by FCFS.",
    )
    top_k: int = Field(-1, description="rlt: keep the k most likely tokens; -1 or 0 disables.")
    ignore_eos: bool = Field(False, description="rlt: keep generating past end-of-sequence.")
    stop_token_ids: list[int] | None = Field(
        None, description="rlt: token ids that end generation (finish_reason 'stop')."
    )
    return_token_ids: bool = Field(
        False, description="rlt: add the generated token ids to each choice (`token_ids`)."
    )


class _CommonOpenAIFields(LoopFields):
    """OpenAI fields both endpoints share."""

    model: str | None = Field(
        None, description="The served model name (GET /v1/models); omitted means that model."
    )
    temperature: float = Field(1.0, description=">= 0; 0 is greedy (argmax).")
    top_p: float = Field(1.0, description="Nucleus mass in (0, 1].")
    seed: int | None = Field(
        None,
        description="Seed of this request's private random stream, in [0, 2**63); "
        "omitted draws one at random.",
    )
    stop: str | list[str] | None = Field(
        None, description="Strings that end generation; the match is not returned."
    )
    n: int = Field(1, description="Only 1 is supported.")
    stream: bool = Field(False, description="Stream the answer as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    presence_penalty: float = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only null/{} is supported.")
    user: str | None = Field(None, description="Accepted and ignored.")


Prompt = Annotated[
    str | list[str] | list[int] | list[list[int]],
    Field(
        description="A string, a list of strings, a list of token ids, or a list of "
        "token-id lists; several prompts give one choice each (index = prompt position)."
    ),
]


class CompletionRequest(_CommonOpenAIFields):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int = Field(
        16, description="Tokens to generate (>= 1); prompt + max_tokens - 1 must fit the context."
    )
    logprobs: int | None = Field(
        None,
        description="Return the sampled token's log-probability and this many most "
        "likely alternatives (0..20).",
    )
    echo: bool = Field(False, description="Only false is supported.")
    best_of: int | None = Field(None, description="Only 1 (or null) is supported.")
    suffix: str | None = Field(None, description="Only null is supported.")


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, description="Accepted and ignored.")


class ResponseFormat(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"] = Field("text", description="Only 'text' is supported.")


class ChatCompletionRequest(_CommonOpenAIFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        description="Rendered with the model's chat template (add_generation_prompt=true)."
    )
    max_tokens: int | None = Field(
        None, description="Tokens to generate (>= 1); default: what is left of the context."
    )
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Return log-probabilities of the sampled tokens.")
    top_logprobs: int | None = Field(
        None, description="With logprobs=true: this many most likely alternatives (0..20)."
    )
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Only null/[] is supported.")
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="Accepted without tools only."
    )
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")


# -- responses ---------------------------------------------------------------------------------
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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None
    exit_depths: list[int] = Field(
        description="rlt: loops each generated token's hidden state went through (token 0 "
        "comes from prefill at the full depth). In a stream: those of this chunk's tokens."
    )
    token_ids: list[int] | None = Field(None, description="rlt: with return_token_ids=true.")


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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None
    exit_depths: list[int] = Field(description="rlt: as in CompletionChoice.")
    token_ids: list[int] | None = Field(None, description="rlt: with return_token_ids=true.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Only the fields a chunk sets are sent (the role in the first chunk, then content)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None
    exit_depths: list[int] = Field(description="rlt: exit depths of this chunk's tokens.")
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
    num_loops: int = Field(description="rlt: model depth (loops per token at most).")


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
