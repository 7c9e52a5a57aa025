"""Prompt input processing: tokenization, chat-template rendering and prompt validation.

rlt-serve loads nothing: the tokenizer object comes from the service that built the engine.
Only the few methods below are used (a Hugging Face tokenizer has them all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rlt_contracts import ModelInfo

from rlt_serve.errors import invalid
from rlt_serve.schemas import ChatMessage

CHAT_TURN_END = "<|im_end|>"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


def completion_prompts(prompt: str | list, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of every prompt of a /v1/completions request (see schemas.Prompt)."""
    if isinstance(prompt, str):
        return [_encode_text(prompt, tokenizer, "prompt")]
    if not prompt:
        raise invalid("prompt", "prompt: the prompt list is empty")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, str) for item in prompt):
        return [_encode_text(text, tokenizer, f"prompt[{i}]") for i, text in enumerate(prompt)]
    return [list(ids) for ids in prompt]


def _encode_text(text: str, tokenizer: Tokenizer, param: str) -> list[int]:
    if not text:
        raise invalid(param, f"{param}: the prompt is empty")
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(messages: list[ChatMessage], tokenizer: Tokenizer) -> list[int]:
    """Render `messages` with the model's chat template and tokenize the result."""
    if not messages:
        raise invalid("messages", "messages: at least one message is required")
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None:
            raise invalid(f"messages[{i}].content", f"messages[{i}].content: content is required")
        role = "system" if message.role == "developer" else message.role
        conversation.append({"role": role, "content": content})
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja2 errors, or a tokenizer without a chat template
        raise invalid("messages", f"messages: cannot render the chat template: {exc}") from exc
    if not isinstance(text, str) or not text:
        raise invalid("messages", "messages: the chat template rendered an empty prompt")
    # The rendered text already holds the template's special tokens; add no more.
    return list(tokenizer.encode(text, add_special_tokens=False))


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


def check_prompt(token_ids: list[int], info: ModelInfo, *, param: str) -> None:
    """400 naming `param` for an empty prompt, an id outside the vocabulary, or a prompt that
    leaves no room to generate within the context."""
    if not token_ids:
        raise invalid(param, f"{param}: the prompt is empty")
    for token in token_ids:
        if not 0 <= token < info.vocab_size:
            raise invalid(
                param, f"{param}: token id {token} is not in the vocabulary [0, {info.vocab_size})"
            )
    if len(token_ids) > info.max_model_len:
        raise invalid(
            param,
            f"{param}: the prompt is {len(token_ids)} tokens but the context length is "
            f"{info.max_model_len}",
        )


def check_max_tokens(prompt_len: int, max_tokens: int, info: ModelInfo, *, param: str) -> None:
    """prompt + max_tokens - 1 positions must fit the context (the last token is never fed back)."""
    if max_tokens < 1:
        raise invalid(param, f"{param}: must be >= 1, got {max_tokens}")
    if prompt_len + max_tokens - 1 > info.max_model_len:
        room = info.max_model_len - prompt_len + 1
        raise invalid(
            param,
            f"{param}: {max_tokens} tokens after a {prompt_len}-token prompt exceed the context "
            f"length {info.max_model_len} (at most {room})",
        )
