"""Structured output's grammar engine: xgrammar behind the `ConstraintCompiler` contract.

xgrammar was chosen by measurement (docs/results.md, "Structured output: grammar engine"): for
a 151,936-token vocabulary it computes a next-token bitmask in 2-3 us median (llguidance 10-56
us) at a lower p99; its cold compile (about 0.1 s for a JSON schema on a 2-core CPU) is paid
once per distinct grammar and then served from its cache.

`XGrammarCompiler` turns a `StructuredOutput` into a fresh `XGrammarConstraint` (one matcher per
request). The scheduler owns the matchers (host request-progression state); this module only
builds them. JSON is compact: no free whitespace between tokens (xgrammar's `any_whitespace`
off, vLLM's `disable_any_whitespace`), so a model cannot stall in whitespace. The grammar's stop
tokens are the model's EOS ids: a matcher terminates once it has accepted one of them after the
grammar is complete, and EOS is allowed only then.

The compiler loads the tokenizer and builds xgrammar's vocabulary table on first use (about a
second for a 151k vocabulary), so engines that never see a structured request pay nothing.
`compile_grammar` is thread-safe: the async server compiles on a worker thread before it
submits, so the engine thread's `compile` finds the grammar in the cache.

JSON strings never hold raw control characters (RFC 8259 section 7): xgrammar 0.2's schema
converter excludes U+0000-U+001F from plain strings but not from strings with a `minLength` /
`maxLength` (their characters are `[^"\\\r\n]`), and byte-level vocabularies have single-byte
tokens for them, so a model could write output that `json.loads` rejects (seen on an H200).
`_json_grammar` tightens that character class in the converted grammar before compiling it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlt_contracts import InvalidRequestError, StructuredOutput, StructuredOutputKind

_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# a string character in xgrammar's EBNF for bounded-length strings, and the JSON-valid class
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


class XGrammarConstraint:
    """One request's matcher (`rlt_contracts.TokenConstraint`)."""

    def __init__(self, matcher: Any, bitmask: Any) -> None:
        self._matcher = matcher
        self._bitmask = bitmask  # torch int32 [1, ceil(V / 32)], reused for every token

    def allowed_token_bitmask(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarCompiler:
    """`rlt_contracts.ConstraintCompiler` over xgrammar for one model's vocabulary.

    tokenizer_loader: returns the model's Hugging Face tokenizer (called once, lazily).
    vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's, padding ids
      are never allowed). stop_token_ids: the model's EOS ids (the grammar's stop tokens).
    """

    def __init__(
        self,
        tokenizer_loader: Callable[[], Any],
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
    ) -> None:
        self._loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None

    def _grammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar  # imports torch and transformers: only when first needed

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._loader(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids) or None,
                )
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    def compile_grammar(self, spec: StructuredOutput):
        """The compiled grammar of `spec` (cached by xgrammar); InvalidRequestError naming
        `spec.field` when the schema or pattern cannot be compiled."""
        compiler = self._grammar_compiler()
        try:
            if spec.kind is StructuredOutputKind.JSON_SCHEMA:
                return compiler.compile_grammar(_json_grammar(spec.json_schema, strict=True))
            if spec.kind is StructuredOutputKind.JSON_OBJECT:
                return compiler.compile_grammar(
                    _json_grammar(json.dumps({"type": "object"}), strict=False)
                )
            if spec.kind is StructuredOutputKind.REGEX:
                return compiler.compile_regex(spec.regex)
            return compiler.compile_grammar(_choice_grammar(spec.choices))
        except (RuntimeError, ValueError, TypeError) as exc:
            what = "schema" if spec.kind is StructuredOutputKind.JSON_SCHEMA else "grammar"
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = _LOCATION.sub("", lines[0])  # xgrammar prefixes "[time] file.cc:line: "
            raise InvalidRequestError(spec.field, f"invalid {what}: {message}") from None

    def compile(self, spec: StructuredOutput) -> XGrammarConstraint:
        import xgrammar

        compiled = self.compile_grammar(spec)
        matcher = xgrammar.GrammarMatcher(compiled)
        return XGrammarConstraint(matcher, xgrammar.allocate_token_bitmask(1, self.vocab_size))


@functools.lru_cache(maxsize=256)
def _json_grammar(schema: str, *, strict: bool) -> str:
    """xgrammar's EBNF for `schema` (compact separators), with JSON-valid string characters.
    Cached: xgrammar caches the compiled grammar by this text, the conversion is ours."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly `choices` (string literals in JSON escaping)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
