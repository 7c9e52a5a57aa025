"""Incremental detokenization and stop strings (output processing, module M1).

Text grows token by token without decoding the whole output every step: only a short window
of recent tokens is decoded. A window ending in an incomplete UTF-8 sequence (U+FFFD) is held
back until the next token completes it, so streamed text never contains broken characters.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
WINDOW_TOKENS = 6  # tokens decoded before the new ones, so merges across tokens decode right


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
        self._stop = tuple(stop)
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens whose text is already in `text`
        self.text = ""
        self.stopped = False

    def _decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=self._skip_special)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the text (a character whose bytes are incomplete waits)."""
        if self.stopped:
            return
        before = len(self.text)
        for token in token_ids:
            self._tokens.append(token)
            window_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset :])
            if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(window_text):
                continue
            self.text += full_text[len(window_text) :]
            self._prefix_offset = max(self._read_offset - WINDOW_TOKENS, 0)
            self._read_offset = len(self._tokens)
            if self._stop and self._apply_stop(search_from=max(before - self._longest_stop(), 0)):
                break

    def flush(self) -> None:
        """At the end of generation, add the text of trailing incomplete bytes (as U+FFFD)."""
        if self.stopped or self._read_offset == len(self._tokens):
            return
        window_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        self.text += self._decode(self._tokens[self._prefix_offset :])[len(window_text) :]
        self._read_offset = len(self._tokens)

    def _longest_stop(self) -> int:
        return max(len(s) for s in self._stop)

    def _apply_stop(self, search_from: int) -> bool:
        matches = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if not matches:
            return False
        self.text = self.text[: min(matches)]
        self.stopped = True
        return True
