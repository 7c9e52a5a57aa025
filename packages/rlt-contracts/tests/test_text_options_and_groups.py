"""SamplingParams' text fields (vLLM names and defaults) and EngineRequest.sibling_group."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import EngineRequest, InvalidRequestError, SamplingParams

TEXT_FIELDS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def test_text_fields_default_as_vllm():
    params = SamplingParams()
    assert params.include_stop_str_in_output is False
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True


@pytest.mark.parametrize("name", TEXT_FIELDS)
@pytest.mark.parametrize("value", [0, 1, "true", None])
def test_text_fields_must_be_booleans(name, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name


def test_sibling_group_is_optional_and_round_trips():
    params = SamplingParams(max_tokens=3, skip_special_tokens=False)
    plain = EngineRequest("a", (1, 2), params)
    assert plain.sibling_group is None
    grouped = EngineRequest("b", (1, 2), params, sibling_group="cmpl-1-p0")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(grouped), type=EngineRequest)
    assert decoded == grouped and decoded.sampling.skip_special_tokens is False
