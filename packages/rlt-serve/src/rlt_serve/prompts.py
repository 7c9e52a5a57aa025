"""Prompt input processing: tokenization and prompt validation (chat_template.py renders chats).

rlt-serve loads nothing: the tokenizer object comes from the service that built the engine.
Only the few methods below are used (a Hugging Face tokenizer has them all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rlt_contracts import ModelInfo

from rlt_serve.errors import CONTEXT_LENGTH_EXCEEDED, invalid


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def completion_prompts(prompt: str | list, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of every prompt of a /v1/completions request (see request_schemas.Prompt)."""
    if isinstance(prompt, str):
        return [_encode_prompt(prompt, tokenizer, "prompt")]
    if not prompt:
        raise invalid("prompt", "prompt: the prompt list is empty")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, str) for item in prompt):
        return [_encode_prompt(text, tokenizer, f"prompt[{i}]") for i, text in enumerate(prompt)]
    return [list(ids) for ids in prompt]


def prompt_texts(prompt: str | list, token_ids: list[list[int]], tokenizer: Tokenizer) -> list[str]:
    """The text of every prompt (echo): as given, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in token_ids]


def _encode_prompt(text: str, tokenizer: Tokenizer, param: str) -> list[int]:
    if not text:
        raise invalid(param, f"{param}: the prompt is empty")
    return encode_text(text, tokenizer, param)


def encode_text(text: str, tokenizer: Tokenizer, param: str) -> list[int]:
    """Tokenize without adding special tokens; a text the tokenizer refuses is a 400 naming
    `param`, never a 500."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:  # noqa: BLE001 - e.g. TypeError for text that is not valid Unicode
        raise invalid(param, f"{param}: the tokenizer cannot encode this text: {exc}") from exc


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
            code=CONTEXT_LENGTH_EXCEEDED,
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
            code=CONTEXT_LENGTH_EXCEEDED,
        )
