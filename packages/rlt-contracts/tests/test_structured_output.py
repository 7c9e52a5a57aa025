"""`StructuredOutput` validation: each kind needs its payload; errors name the request field."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)


def test_kinds_and_round_trip():
    specs = [
        StructuredOutput(kind="json_schema", json_schema='{"type": "object"}'),
        StructuredOutput(kind="json_object"),
        StructuredOutput(kind="regex", regex="[a-z]+"),
        StructuredOutput(kind="choice", choices=["yes", "no"], field="guided_choice"),
    ]
    for spec in specs:
        assert isinstance(spec.kind, StructuredOutputKind)
        params = SamplingParams(structured_output=spec)
        again = msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams)
        assert again.structured_output == spec and hash(again.structured_output) == hash(spec)
    assert specs[3].choices == ("yes", "no")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "xml"}, "unknown structured output kind"),
        ({"kind": "json_schema"}, "a JSON schema is required"),
        ({"kind": "json_schema", "json_schema": "{nope"}, "not JSON"),
        ({"kind": "json_schema", "json_schema": "[1]"}, "must be a JSON object"),
        ({"kind": "regex", "regex": ""}, "non-empty regular expression"),
        ({"kind": "choice"}, "choices are required"),
        ({"kind": "choice", "choices": ("a", "")}, "non-empty string"),
        ({"kind": "json_object", "regex": "a"}, "regex is not used by json_object"),
    ],
)
def test_invalid_specs_name_their_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        StructuredOutput(field="response_format", **kwargs)
    assert error.value.field == "response_format"
