"""Incremental detokenization and stop strings (output processing, module M1).

Each token is decoded once, with the tokenizers library's `DecodeStream`, which keeps the
little state byte-level BPE needs (the previous tokens whose bytes merge with the next ones) and
returns nothing while a character's UTF-8 bytes are incomplete, so streamed text never contains
broken characters and no window of earlier tokens is decoded again.

The request's text options (`SamplingParams`) follow vLLM's detokenizer for fast tokenizers:

- `skip_special_tokens` (default True) is the `DecodeStream`'s own switch: special tokens add
  no text.
- `include_stop_str_in_output` (default False): a matched stop string is cut from the text
  (False) or kept, with the text ending right after it (True). Likewise the token that ended
  the request as a stop token (EOS, `stop_token_ids`) is not detokenized unless it is True.
- `spaces_between_special_tokens` (default True) matters only with `skip_special_tokens=False`:
  False writes an added token that follows another added token as its bare content, dropping
  whatever separator the tokenizer's decoder would put before it (vLLM's rule for fast
  tokenizers; the "spaces between" of slow Hugging Face tokenizers is not modelled). Byte-level
  decoders (Ouro's, rlt's test tokenizers) put no separator there, so it changes nothing for
  them.

`min_tokens` (vLLM's detokenizer rule, vllm#22014): stop strings are not looked for while at
most `min_tokens` tokens were generated, and a later match must end in text that came after
the `min_tokens`-th token (it may start up to len(stop) - 1 characters before it). The device
keeps stop token ids from being sampled before then (rlt_sampling.logits_processing).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


def backend_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text; optionally stops at stop strings.

    text: the text so far (see the module docstring for what the options keep); stopped: a stop
    string matched. `text` only grows, except that a stop match cuts it: at the match, or
    (include_stop_str_in_output) right after it, which is never before text an earlier call
    already had. Streaming frontends therefore hold back the last len(longest stop) - 1
    characters until the request ends unless the stop string is kept (serving/deltas.py).
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._stop_token_ids = frozenset(stop_token_ids)
        # id -> content of added tokens, when consecutive ones are written bare
        self._bare_added: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._bare_added = {
                token_id: added.content
                for token_id, added in self._backend.get_added_tokens_decoder().items()
            }
        self._last_added = False
        self._held: list[int] = []  # tokens whose text the stream has not released yet
        self._min_tokens = min_tokens
        self._num_tokens = 0  # tokens added so far
        # a stop match must end after this text offset (the end of the min_tokens-th token)
        self._stop_floor = 0
        self.text = ""
        self.stopped = False

    def add_tokens(self, token_ids: Sequence[int], *, ends_on_stop_token: bool = False) -> None:
        """Append tokens to the text (a character whose bytes are incomplete waits).

        ends_on_stop_token: the last id ended the request as a stop token; its text is left
        out unless `include_stop_str_in_output` (the caller knows why the request finished).
        """
        if self.stopped:
            return
        if ends_on_stop_token and not self._include_stop and token_ids:
            if token_ids[-1] in self._stop_token_ids:
                token_ids = token_ids[:-1]
        before = len(self.text)
        for token in token_ids:
            self._num_tokens += 1
            piece = self._stream.step(self._backend, token)
            if self._bare_added:
                content = self._bare_added.get(token)
                if content is not None and self._last_added:
                    piece = content
                self._last_added = content is not None
            if piece is None:
                self._held.append(token)
            else:
                self._held.clear()
                self.text += piece
            if self._num_tokens <= self._min_tokens:
                self._stop_floor = len(self.text)
                continue
            if piece is None:
                continue
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
        """Cut the text at the earliest stop match (the first listed among matches starting
        at the same place): before it, or after it with include_stop_str_in_output."""
        matches = [
            (start, len(stop))
            for stop in self._stop
            if (start := self.text.find(stop, max(search_from, self._stop_floor - len(stop) + 1)))
            >= 0
        ]
        if not matches:
            return False
        start, length = min(matches, key=lambda match: match[0])
        self.text = self.text[: start + length if self._include_stop else start]
        self.stopped = True
        return True
