"""SamplingParams' vLLM sampling extensions: defaults, ranges (errors name the field), the
logit_bias copy, and the flags the runner reads."""

from __future__ import annotations

import math

import msgspec
import pytest
from rlt_contracts import EngineRequest, InvalidRequestError, SamplingMode, SamplingParams


def test_defaults_are_neutral_as_in_vllm():
    params = SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (params.min_p, params.min_tokens, params.logit_bias) == (0.0, 0, None)
    assert not params.penalized and not params.adjusts_logits
    assert not SamplingMode().adjusts_logits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("min_tokens", 2.0),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: -101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("logit_bias", [(5, 1.0)]),
    ],
)
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize(
    "changes",
    [
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"min_p": 1.0},
        {"min_tokens": 16},
        {"logit_bias": {i: 100.0 if i % 2 else -100.0 for i in range(300)}},
    ],
)
def test_boundary_values_are_accepted(changes):
    SamplingParams(**changes)


def test_logit_bias_is_a_private_copy_and_empty_means_none():
    bias = {3: 1, 7: -2.5}
    params = SamplingParams(logit_bias=bias)
    bias[3] = 99.0
    assert params.logit_bias == {3: 1.0, 7: -2.5}
    assert all(isinstance(v, float) for v in params.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 0.0}).adjusts_logits


def test_flags():
    assert SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=0.1).penalized
    assert not SamplingParams(min_tokens=3).penalized
    assert SamplingParams(min_tokens=3).adjusts_logits
    assert not SamplingParams(min_p=0.2).adjusts_logits  # a filter after temperature
    assert SamplingMode(biased=True).adjusts_logits and not SamplingMode(min_p=True).adjusts_logits


def test_round_trip_through_msgpack_and_json():
    params = SamplingParams(
        max_tokens=8,
        logit_bias={5: 1.5, 300: -3.0},
        min_tokens=2,
        repetition_penalty=1.2,
        min_p=0.05,
    )
    request = EngineRequest("a", (1, 2), params)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest) == request
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
