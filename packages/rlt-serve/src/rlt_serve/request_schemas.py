"""Request bodies of the OpenAI-compatible API, as pydantic models (responses:
response_schemas.py); FastAPI publishes them in its OpenAPI schema, so the schema is exactly
what the server validates. Validation policy (strict types, neutral values, unknown fields,
null means the default): docs/serving.md, "Request fields".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


class RequestModel(BaseModel):
    """A request body (or part of one): strict types, unknown fields refused, and an explicit
    null for a field with a default means that default."""

    model_config = _REQUEST_CONFIG

    @model_validator(mode="after")
    def _null_means_default(self):
        for name, field in type(self).model_fields.items():
            if getattr(self, name) is None and not field.is_required():
                default = field.get_default(call_default_factory=True)
                if default is not None:
                    object.__setattr__(self, name, default)
        return self


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(
        False, description="Send a last chunk (with empty `choices`) carrying `usage`."
    )


class LoopFields(RequestModel):
    """rlt extensions shared by both endpoints (OpenAI clients pass them via `extra_body`)."""

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
        "in [0, 1]; 1.0 runs every token to max_loops. Default: the server's --exit-threshold "
        "(0.5 for a model with an exit gate; SamplingParams in Python defaults to 1.0).",
    )
    priority: int | None = Field(
        0,
        description="rlt: admission priority under the 'priority' scheduling policy "
        "(lower runs first); ignored by FCFS.",
    )
    top_k: int | None = Field(
        -1, description="rlt: keep the k most likely tokens; -1 or 0 disables."
    )
    ignore_eos: bool | None = Field(False, description="rlt: keep generating past end-of-sequence.")
    repetition_penalty: float | None = Field(
        1.0,
        description="vLLM: > 0; logits of tokens in the prompt or output are divided by it "
        "(positive) or multiplied by it (negative); 1 disables.",
    )
    min_p: float | None = Field(
        0.0,
        description="vLLM: in [0, 1]; drop tokens less likely than min_p times the most likely "
        "(after temperature); 0 disables.",
    )
    min_tokens: int | None = Field(
        0,
        description="vLLM: in [0, max_tokens]; EOS and stop_token_ids cannot end the output "
        "(and stop strings are not checked) before this many tokens.",
    )
    stop_token_ids: list[int] | None = Field(
        None,
        description="rlt: token ids that end generation (finish_reason 'stop'); each must be "
        "in the vocabulary.",
    )
    return_token_ids: bool | None = Field(
        False, description="rlt: add the generated token ids to each choice (`token_ids`)."
    )
    include_stop_str_in_output: bool | None = Field(
        False,
        description="vLLM: keep a matched stop string (the text ends right after it) and the "
        "text of the stop token that ended generation.",
    )
    skip_special_tokens: bool | None = Field(
        True, description="vLLM: leave special tokens' text out of the output."
    )
    spaces_between_special_tokens: bool | None = Field(
        True,
        description="vLLM: with skip_special_tokens=false, false writes an added token that "
        "follows another added token without the separator the tokenizer's decoder puts "
        "before it.",
    )


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`."""

    name: str | None = Field(None, description="The schema's name (accepted, not used).")
    description: str | None = Field(None, description="Accepted, not used.")
    schema_: dict[str, Any] | bool | None = Field(
        None,
        alias="schema",
        description="The JSON schema the output must satisfy; omitted allows any JSON object.",
    )
    strict: bool | None = Field(
        None, description="Accepted; the schema is always enforced (token masks)."
    )


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] | None = Field(
        "text",
        description="'text' (no constraint), 'json_object' (any JSON object) or 'json_schema'.",
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="With type 'json_schema'.")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | bool | str | None = Field(
        None, alias="json", description="A JSON schema (object or JSON text)."
    )
    regex: str | None = Field(None, description="The whole output must match it.")
    choice: list[str] | None = Field(None, description="The output is one of these.")
    json_object: bool | None = Field(None, description="true: any JSON object.")


class StructuredOutputFields(RequestModel):
    """Structured output (docs/serving.md): at most one of these per request."""

    response_format: ResponseFormat | None = Field(
        None, description="OpenAI: text, json_object or json_schema."
    )
    guided_json: dict[str, Any] | bool | str | None = Field(
        None, description="vLLM: a JSON schema (object or JSON text) the output satisfies."
    )
    guided_regex: str | None = Field(None, description="vLLM: the output fully matches it.")
    guided_choice: list[str] | None = Field(None, description="vLLM: the output is one of these.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM: json, regex, choice or json_object."
    )


class _CommonOpenAIFields(LoopFields, StructuredOutputFields):
    """OpenAI fields both endpoints share."""

    score_at_exit_depth: bool | None = Field(
        False,
        description="rlt: score the prompt (prompt_logprobs, or completions' echo with "
        "logprobs) with every position at the loop where this request's exit rule fires, as "
        "a decode fed the prompt token by token would, instead of at full depth; each "
        "position's exit depth comes back in prompt_exit_depths. 400 without prompt scoring.",
    )

    model: str | None = Field(
        None, description="The served model name (GET /v1/models); omitted means that model."
    )
    # 1.0 as in OpenAI's API; `rlt generate` and SamplingParams() default to 0 (greedy),
    # the playground's form to 0.7 (docs/configuration.md, "Defaults by entry point")
    temperature: float | None = Field(
        1.0, description=">= 0; 0 is greedy (argmax). Default 1.0, as OpenAI's API."
    )
    top_p: float | None = Field(1.0, description="Nucleus mass in (0, 1].")
    seed: int | None = Field(
        None,
        description="Seed of this request's private random stream, in [0, 2**63); "
        "omitted draws one at random.",
    )
    stop: str | list[str] | None = Field(
        None, description="Strings that end generation; the match is not returned."
    )
    n: int | None = Field(
        1,
        description="Choices per prompt (1..128), each with its own random stream; with a seed, "
        "choice i samples with seed + i.",
    )
    stream: bool | None = Field(False, description="Stream the answer as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    presence_penalty: float | None = Field(
        0.0,
        description="In [-2, 2]; subtracted from the logit of every token already in the output.",
    )
    frequency_penalty: float | None = Field(
        0.0,
        description="In [-2, 2]; times a token's count in the output, subtracted from its logit.",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (a string key) -> bias in [-100, 100] added to its logit; at most "
        "300 entries, ids in the vocabulary.",
    )
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
    max_tokens: int | None = Field(
        16,
        description="Tokens to generate (>= 1; 0 with echo and logprobs, or with "
        "prompt_logprobs, scores the prompt without generating); prompt + max_tokens - 1 must "
        "fit the context.",
    )
    logprobs: int | None = Field(
        None,
        description="Return the sampled token's log-probability and this many most "
        "likely alternatives (0..20).",
    )
    echo: bool | None = Field(
        False,
        description="Prepend the prompt's text to the choice's text (with logprobs: its tokens "
        "come first with their full-depth log-probabilities, null for the first).",
    )
    prompt_logprobs: int | None = Field(
        None,
        description="vLLM: score every prompt token at full depth and return it with this "
        "many most likely alternatives (0..20) in the choice's prompt_logprobs.",
    )
    best_of: int | None = Field(
        None,
        description="Sequences generated per prompt (n..128, default n); the n of highest "
        "cumulative log-probability are returned. best_of > n cannot stream.",
    )
    suffix: str | None = Field(None, description="Only null is supported.")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object, encoded as a string.")


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(
        None, description="Required, except on an assistant message with tool_calls."
    )
    name: str | None = Field(None, description="Passed to the chat template.")
    tool_calls: list[ToolCall] | None = Field(
        None,
        description="Assistant messages: earlier tool calls, rendered only by a chat template "
        "that knows tool calls (400 otherwise).",
    )
    tool_call_id: str | None = Field(
        None, description="Tool messages: the call this result answers (passed to the template)."
    )


class ChatCompletionRequest(_CommonOpenAIFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="Rendered with the model's chat template.")
    add_generation_prompt: bool | None = Field(
        True, description="End the prompt with the template's assistant-turn opening."
    )
    continue_final_message: bool | None = Field(
        False,
        description="Continue the final message (usually the assistant's) instead of starting "
        "a new turn: rendered open, without its closing tokens; needs "
        "add_generation_prompt=false.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template."
    )
    echo: bool | None = Field(
        False,
        description="When the last message is the assistant's, the reply's content begins "
        "with that message's content.",
    )
    max_tokens: int | None = Field(
        None, description="Tokens to generate (>= 1); default: what is left of the context."
    )
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens.")
    logprobs: bool | None = Field(
        False, description="Return log-probabilities of the sampled tokens."
    )
    top_logprobs: int | None = Field(
        None, description="With logprobs=true: this many most likely alternatives (0..20)."
    )
    prompt_logprobs: int | None = Field(
        None,
        description="vLLM: score every token of the rendered prompt at full depth and return "
        "it with this many most likely alternatives (0..20) in the response's prompt_logprobs "
        "(not streamed).",
    )
    best_of: int | None = Field(
        None,
        description="vLLM extension: sequences generated (n..128, default n); the n of "
        "highest cumulative log-probability are returned. best_of > n cannot stream.",
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Only null/[] is supported.")
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="Accepted without tools only."
    )
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
