"""Structured output: what a request constrains its output to, and the host-side matcher.

A request's `SamplingParams.structured_output` names a grammar (`StructuredOutput`). The engine
compiles it once per request into a `TokenConstraint` (through a `ConstraintCompiler`, which
the engine service implements with a grammar library; rlt-contracts stays dependency-free). The
scheduler owns the constraint (host state keyed by the request's identity, R02): before each
output token it asks for the allowed-token bitmask and sends it with the step (`TokenMask`);
after the token is read back it advances the constraint with it. The device applies the mask
to the row's raw logits (disallowed tokens -> -inf), so greedy and random rows both honour it.

Because the mask of output i + 1 depends on output i, a constrained request produces at most
one token per step and is never in two steps in flight (`DecodeRule.one_output_per_step`).
"""

from __future__ import annotations

import enum
import json
from typing import Protocol

import msgspec

from rlt_contracts.errors import InvalidRequestError
from rlt_contracts.requests import ExecutionIdentity

MAX_CHOICES = 1024


class StructuredOutputKind(enum.StrEnum):
    """JSON_SCHEMA: a JSON document valid under `json_schema`. JSON_OBJECT: any JSON object.
    REGEX: text that fully matches `regex`. CHOICE: exactly one of `choices`."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The grammar of one request's output. Immutable and hashable (a compile-cache key).

    json_schema: JSON_SCHEMA only: the schema as JSON text (an object, or true).
    regex: REGEX only: the pattern (the whole output must match it).
    choices: CHOICE only: the allowed outputs (non-empty strings, at least one).
    field: the request field it came from (e.g. "response_format", "guided_json"); errors of
      the grammar (invalid schema or pattern) name it.
    """

    kind: StructuredOutputKind
    json_schema: str | None = None
    regex: str | None = None
    choices: tuple[str, ...] = ()
    field: str = "structured_output"

    def __post_init__(self) -> None:
        try:
            kind = StructuredOutputKind(self.kind)
        except ValueError:
            raise InvalidRequestError(
                self.field, f"unknown structured output kind {self.kind!r}"
            ) from None
        msgspec.structs.force_setattr(self, "kind", kind)
        if not isinstance(self.choices, tuple):
            msgspec.structs.force_setattr(self, "choices", tuple(self.choices))
        wants = {
            StructuredOutputKind.JSON_SCHEMA: "json_schema",
            StructuredOutputKind.REGEX: "regex",
            StructuredOutputKind.CHOICE: "choices",
        }.get(kind)
        for name in ("json_schema", "regex", "choices"):
            if name != wants and getattr(self, name):
                raise InvalidRequestError(self.field, f"{name} is not used by {kind.value}")
        if kind is StructuredOutputKind.JSON_SCHEMA:
            if not isinstance(self.json_schema, str):
                raise InvalidRequestError(self.field, "a JSON schema is required")
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise InvalidRequestError(self.field, f"the schema is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(self.field, "the schema must be a JSON object")
        elif kind is StructuredOutputKind.REGEX:
            if not isinstance(self.regex, str) or not self.regex:
                raise InvalidRequestError(self.field, "a non-empty regular expression is required")
        elif kind is StructuredOutputKind.CHOICE:
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidRequestError(
                    self.field, f"between 1 and {MAX_CHOICES} choices are required"
                )
            if not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidRequestError(self.field, "every choice must be a non-empty string")


class TokenConstraint(Protocol):
    """One request's grammar matcher: host state that has consumed exactly the request's
    output tokens so far. Owned by the scheduler; used from the engine thread only."""

    def allowed_token_bitmask(self) -> bytes:
        """The next token's allowed set: ceil(V / 32) little-endian int32 words, bit t % 32 of
        word t // 32 set when token t may be sampled (EOS only where the grammar may end)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (state unchanged)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar reached its end (its stop token was accepted): the request is done."""
        ...


class ConstraintCompiler(Protocol):
    """Builds matchers for one vocabulary (the engine service implements it)."""

    def compile(self, spec: StructuredOutput) -> TokenConstraint:
        """A fresh matcher of `spec`. Raises InvalidRequestError(spec.field, why) for a grammar
        the engine cannot compile (invalid schema or pattern). Compiled grammars may be cached
        (keyed by `spec`); matchers never are."""
        ...


class TokenMask(msgspec.Struct, frozen=True, array_like=True):
    """The allowed-token bitmask of a constrained request's next output, sent with a step.

    words: ceil(V / 32) little-endian int32 words (`TokenConstraint.allowed_token_bitmask`).
    The runner writes them into the request's row and lets the row sample one more token.
    """

    identity: ExecutionIdentity
    words: bytes
