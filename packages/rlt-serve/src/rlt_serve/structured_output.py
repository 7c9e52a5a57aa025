"""Structured-output request fields -> `StructuredOutput` (OpenAI's and vLLM's spellings).

Accepted, on /v1/chat/completions and /v1/completions (as vLLM does):

- OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object), {"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}.
- vLLM's `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice`
  (a list of strings), and the newer `structured_outputs` object with one of `json`, `regex`,
  `choice` or `json_object: true`.

At most one of them may constrain a request (400 naming the second). The grammar itself is
compiled by the engine; an invalid schema or pattern is a 400 naming the field it came from
(e.g. `response_format.json_schema.schema`, `guided_regex`).
"""

from __future__ import annotations

import json
from typing import Any

from rlt_contracts import InvalidRequestError, StructuredOutput, StructuredOutputKind

from rlt_serve.errors import invalid


def structured_output_of(request: Any) -> StructuredOutput | None:
    """The request's grammar (None: unconstrained); APIError 400 naming the field if the
    fields are inconsistent. `request` is a completion or chat request model."""
    found: list[StructuredOutput] = []
    try:
        found += _from_response_format(getattr(request, "response_format", None))
        found += _from_guided_fields(request)
        found += _from_structured_outputs(getattr(request, "structured_outputs", None))
    except InvalidRequestError as exc:
        raise invalid(exc.field, f"{exc.field}: {exc.message}") from exc
    if len(found) > 1:
        second = found[1].field.split(".")[0]
        raise invalid(
            second,
            f"{second}: only one structured-output constraint per request "
            f"({found[0].field.split('.')[0]} is already given)",
        )
    return found[0] if found else None


def _schema_text(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        return schema  # JSON text; StructuredOutput checks that it parses
    if isinstance(schema, dict | bool):
        return json.dumps(schema)
    raise InvalidRequestError(field, "must be a JSON schema (an object)")


def _from_response_format(response_format: Any) -> list[StructuredOutput]:
    if response_format is None or response_format.type in (None, "text"):
        if response_format is not None and response_format.json_schema is not None:
            raise InvalidRequestError(
                "response_format.json_schema", "only used with type 'json_schema'"
            )
        return []
    if response_format.type == "json_object":
        if response_format.json_schema is not None:
            raise InvalidRequestError(
                "response_format.json_schema", "only used with type 'json_schema'"
            )
        return [StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT, field="response_format")]
    spec = response_format.json_schema
    if spec is None:
        raise InvalidRequestError("response_format.json_schema", "required with type 'json_schema'")
    if spec.schema_ is None:  # OpenAI: a missing schema allows any JSON (vLLM: any object)
        return [StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT, field="response_format")]
    field = "response_format.json_schema.schema"
    return [
        StructuredOutput(
            kind=StructuredOutputKind.JSON_SCHEMA,
            json_schema=_schema_text(spec.schema_, field),
            field=field,
        )
    ]


def _from_guided_fields(request: Any) -> list[StructuredOutput]:
    found = []
    guided_json = getattr(request, "guided_json", None)
    if guided_json is not None:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.JSON_SCHEMA,
                json_schema=_schema_text(guided_json, "guided_json"),
                field="guided_json",
            )
        )
    guided_regex = getattr(request, "guided_regex", None)
    if guided_regex is not None:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.REGEX, regex=guided_regex, field="guided_regex"
            )
        )
    guided_choice = getattr(request, "guided_choice", None)
    if guided_choice is not None:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.CHOICE,
                choices=tuple(guided_choice),
                field="guided_choice",
            )
        )
    return found


def _from_structured_outputs(fields: Any) -> list[StructuredOutput]:
    if fields is None:
        return []
    found = []
    if fields.json_ is not None:
        field = "structured_outputs.json"
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.JSON_SCHEMA,
                json_schema=_schema_text(fields.json_, field),
                field=field,
            )
        )
    if fields.regex is not None:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.REGEX,
                regex=fields.regex,
                field="structured_outputs.regex",
            )
        )
    if fields.choice is not None:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.CHOICE,
                choices=tuple(fields.choice),
                field="structured_outputs.choice",
            )
        )
    if fields.json_object:
        found.append(
            StructuredOutput(
                kind=StructuredOutputKind.JSON_OBJECT, field="structured_outputs.json_object"
            )
        )
    if len(found) > 1:
        raise InvalidRequestError(
            "structured_outputs", "give exactly one of json, regex, choice, json_object"
        )
    if not found:
        raise InvalidRequestError(
            "structured_outputs", "give one of json, regex, choice, json_object"
        )
    return found
