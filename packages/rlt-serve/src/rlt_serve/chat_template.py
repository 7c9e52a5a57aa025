"""Chat messages -> prompt token ids, through the tokenizer's chat template.

The messages become the conversation a Hugging Face chat template expects (`developer` renders
as `system`; text parts are joined; `name`, `tool_call_id` and assistant `tool_calls`, with
their arguments parsed into objects, are passed on). A template that never mentions
`tool_calls` cannot render them, so a conversation holding some answers 400 there instead of
silently dropping them.

The template is the tokenizer's own unless the server was given one (`--chat-template`:
`build_app(chat_template=...)`, passed here for every rendering). The request's rendering
options (`ChatFields`) are described with their fields (request_schemas.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from rlt_contracts import ConfigurationError

from rlt_serve.errors import invalid
from rlt_serve.prompts import Tokenizer, encode_text
from rlt_serve.request_schemas import ChatMessage

CHAT_TURN_END = "<|im_end|>"

# Parameters of `apply_chat_template` itself (and the variable holding the messages): a
# template variable of that name would change how the template is called, not what it renders.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatFields(Protocol):
    """The chat fields of a request (/v1/chat/completions', /tokenize's)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: Mapping[str, Any] | None


def chat_prompt(body: ChatFields, tokenizer: Tokenizer, chat_template: str | None) -> list[int]:
    """Render `body.messages` with the model's chat template (or `chat_template`, the server's
    --chat-template) under the request's options and tokenize the result."""
    add_generation_prompt = body.add_generation_prompt
    continue_final_message = body.continue_final_message
    if add_generation_prompt and continue_final_message:
        raise invalid(
            "continue_final_message",
            "continue_final_message: cannot be combined with add_generation_prompt=true (set "
            "add_generation_prompt to false to continue the final message)",
        )
    conversation = build_conversation(body.messages, tokenizer, chat_template)
    kwargs = dict(body.chat_template_kwargs or {})
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            param = f"chat_template_kwargs.{name}"
            raise invalid(param, f"{param}: reserved; use the request field instead")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # jinja2 errors, or a tokenizer without a chat template
        raise invalid("messages", f"messages: cannot render the chat template: {exc}") from exc
    if not isinstance(text, str) or not text:
        raise invalid("messages", "messages: the chat template rendered an empty prompt")
    # The rendered text already holds the template's special tokens; add no more.
    return encode_text(text, tokenizer, "messages")


def check_chat_template(tokenizer: Tokenizer, chat_template: str) -> None:
    """A server's --chat-template compiles: rendered once for a one-message conversation by the
    tokenizer's own renderer (jinja2's sandbox, as for every request). A syntax error is a
    `ConfigurationError`; errors the template raises for that conversation (its own checks,
    e.g. of the roles' order) are left to the requests that meet them."""
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}],
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as exc:  # noqa: BLE001 - only a syntax error is the template's fault
        if type(exc).__name__ == "TemplateSyntaxError":
            raise ConfigurationError(
                "chat_template", f"not a valid Jinja template: {exc}"
            ) from None


def build_conversation(
    messages: list[ChatMessage], tokenizer: Tokenizer, chat_template: str | None = None
) -> list[dict[str, Any]]:
    """The template's conversation; 400 naming the message field that cannot be rendered."""
    if not messages:
        raise invalid("messages", "messages: at least one message is required")
    conversation = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        content = message_text(message)
        if content is None:
            if not (message.role == "assistant" and message.tool_calls):
                raise invalid(f"{field}.content", f"{field}.content: content is required")
            content = ""
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content,
        }
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            if message.role != "tool":
                raise invalid(
                    f"{field}.tool_call_id",
                    f"{field}.tool_call_id: only tool messages answer a tool call",
                )
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = _tool_calls(message, field, tokenizer, chat_template)
        conversation.append(entry)
    return conversation


def message_text(message: ChatMessage) -> str | None:
    """A message's content as one string (text parts joined), None when it has none."""
    content = message.content
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content


def chat_stop_token_ids(tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    """The chat turn end (ChatML `<|im_end|>`) as a stop token, when the tokenizer has it."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(CHAT_TURN_END)
    except Exception:  # noqa: BLE001 - a tokenizer without that token
        return ()
    if isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < vocab_size:
        unk = getattr(tokenizer, "unk_token_id", None)
        if token_id != unk:
            return (token_id,)
    return ()


def _tool_calls(
    message: ChatMessage, field: str, tokenizer: Tokenizer, chat_template: str | None
) -> list[dict[str, Any]]:
    if message.role != "assistant":
        raise invalid(
            f"{field}.tool_calls", f"{field}.tool_calls: only assistant messages make tool calls"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tool_calls" not in template:
        raise invalid(
            f"{field}.tool_calls",
            f"{field}.tool_calls: the model's chat template cannot render tool calls",
        )
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        param = f"{field}.tool_calls[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid(param, f"{param}: must be a JSON object encoded as a string")
        calls.append(
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return calls
