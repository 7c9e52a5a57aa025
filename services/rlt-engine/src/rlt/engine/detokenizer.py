"""Incremental detokenization and stop strings (output processing, module M1).

Each token is decoded once, with the tokenizers library's `DecodeStream`, which keeps the
little state byte-level BPE needs (the previous tokens whose bytes merge with the next ones) and
returns nothing while a character's UTF-8 bytes are incomplete, so streamed text never contains
broken characters and no window of earlier tokens is decoded again.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


def backend_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text; optionally stops at stop strings.

    text: the text so far (stop string excluded); stopped: a stop string matched. `text` only
    grows, except that a stop match cuts it at the match; streaming frontends therefore hold
    back the last len(longest stop) - 1 characters until the request ends (serving/deltas.py).
    """

    def __init__(
        self, tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._held: list[int] = []  # tokens whose text the stream has not released yet
        self.text = ""
        self.stopped = False

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the text (a character whose bytes are incomplete waits)."""
        if self.stopped:
            return
        before = len(self.text)
        for token in token_ids:
            piece = self._stream.step(self._backend, token)
            if piece is None:
                self._held.append(token)
                continue
            self._held.clear()
            self.text += piece
            if self._stop and self._apply_stop(search_from=max(before - self._longest_stop(), 0)):
                break

    def flush(self) -> None:
        """At the end of generation, add the text of trailing incomplete bytes (as U+FFFD)."""
        if self.stopped or not self._held:
            return
        self.text += self._tokenizer.decode(self._held, skip_special_tokens=self._skip_special)
        self._held.clear()

    def _longest_stop(self) -> int:
        return max(len(s) for s in self._stop)

    def _apply_stop(self, search_from: int) -> bool:
        matches = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if not matches:
            return False
        self.text = self.text[: min(matches)]
        self.stopped = True
        return True
