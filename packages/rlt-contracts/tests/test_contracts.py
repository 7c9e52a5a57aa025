"""Contracts validate input with typed errors naming the field and serialize stably."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import (
    COLUMNS,
    DEFAULT_GATE_MIN_LOOPS,
    OPTIONAL_COLUMNS,
    AdmissionPlan,
    ConfigurationError,
    DecodeRule,
    ExecutionIdentity,
    ExitRule,
    ExitRuleKind,
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    KVLayout,
    KVLayoutSpec,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    RequestOutputDelta,
    RequestTimings,
    SamplingParams,
    SchedulerOutput,
    TokenLog,
    TokenLogColumns,
    columns_of,
    parse_kv_layout,
    requested_columns,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_loops": 0}, "min_loops"),
        ({"min_loops": 3, "max_loops": 2}, "max_loops"),
        ({"exit_threshold": 1.01}, "exit_threshold"),
        ({"priority": "high"}, "priority"),
        ({"score_at_exit_depth": True}, "score_at_exit_depth"),  # without prompt_logprobs
        ({"prompt_logprobs": 0, "score_at_exit_depth": 1}, "score_at_exit_depth"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_sampling_params_defaults_and_loop_resolution():
    params = SamplingParams()
    assert params.greedy and not params.adaptive_exit
    assert (params.max_tokens, params.min_loops, params.exit_threshold) == (16, None, 1.0)
    assert params.resolve_max_loops(4) == 4
    # an unset min_loops is the model's own default, never above the cap
    assert params.resolve_min_loops(4, DEFAULT_GATE_MIN_LOOPS) == 2
    assert SamplingParams(max_loops=1).resolve_min_loops(1, DEFAULT_GATE_MIN_LOOPS) == 1
    assert params.resolve_min_loops(4, 1) == 1
    assert SamplingParams(min_loops=3).resolve_min_loops(4, 1) == 3
    assert SamplingParams(max_loops=3).resolve_max_loops(4) == 3
    with pytest.raises(InvalidRequestError, match="model depth"):
        SamplingParams(max_loops=6).resolve_max_loops(4)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_loops=3).resolve_max_loops(2)
    assert info.value.field == "min_loops"


def test_an_unset_max_loops_is_the_default_depth_under_a_larger_cap():
    """A model of depth 4 (the engine's loop cap) whose checkpoint runs 2 loops by default."""
    assert SamplingParams().resolve_max_loops(4, default=2) == 2
    assert SamplingParams(max_loops=4).resolve_max_loops(4, default=2) == 4
    # min_loops above the default raises the resolved depth, so the bounds stay ordered
    assert SamplingParams(min_loops=3).resolve_max_loops(4, default=2) == 3
    with pytest.raises(InvalidRequestError, match="--max-model-loops") as info:
        SamplingParams(max_loops=5).resolve_max_loops(4, default=2)
    assert info.value.field == "max_loops"


def test_sampling_params_json_round_trip_and_unknown_fields():
    params = SamplingParams(
        max_tokens=5, temperature=0.7, seed=None, stop=("\n",), exit_threshold=0.6
    )
    encoded = msgspec.json.encode(params)
    assert msgspec.json.decode(encoded, type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 3}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.json.decode(b'{"bogus": 1}', type=SamplingParams)


def test_finish_reason_serializes_to_public_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert msgspec.json.encode(FinishReason.ABORT) == b'"abort"'
    assert str(FinishReason.LENGTH) == "length"


def test_execution_identity_distinguishes_generations():
    first, reused = ExecutionIdentity("req", 1), ExecutionIdentity("req", 2)
    assert first != reused and first == ExecutionIdentity("req", 1)
    assert len({first, reused, ExecutionIdentity("req", 1)}) == 2


def test_kv_layout_planes():
    assert KVLayout.LAST_EXITED.storage_planes(4) == 4
    assert KVLayout.SHARED.storage_planes(4) == 1
    assert [KVLayout.LAST_EXITED.plane_of_loop(k) for k in (1, 4)] == [0, 3]
    assert KVLayout.SHARED.plane_of_loop(3) == 0


def test_kv_layout_specs_parse_and_map_loops_to_planes():
    ring = parse_kv_layout("ring:8")
    assert ring == KVLayoutSpec(KVLayout.RING, 8) and ring.value == str(ring) == "ring:8"
    assert parse_kv_layout("ring:08") == ring  # one canonical spelling
    assert ring.storage_planes(32) == 8 and ring.storage_planes(4) == 4
    assert [ring.plane_of_loop(k) for k in (1, 8, 9, 32)] == [0, 7, 0, 7]
    assert ring.folds_loops(32) and not ring.folds_loops(8)
    assert ring.fills_unreached_planes
    for name, planes, loop_planes in (("last_exited", 4, [0, 3]), ("shared", 1, [0, 0])):
        spec = parse_kv_layout(name)
        assert spec.value == name and spec.storage_planes(4) == planes
        assert spec == parse_kv_layout(KVLayout(name)) and not spec.folds_loops(4)
        assert [spec.plane_of_loop(k) for k in (1, 4)] == loop_planes
    assert not parse_kv_layout("shared").fills_unreached_planes
    for bad in ("ring:0", "ring:", "ring:x", "ring:-2", "ring", "diagonal", "RING:4", 8):
        with pytest.raises(ValueError, match="ring:K"):
            parse_kv_layout(bad)
    with pytest.raises(ValueError, match="ring_planes"):
        KVLayoutSpec(KVLayout.SHARED, 2)
    with pytest.raises(ValueError, match="KVLayoutSpec"):
        KVLayout.RING.storage_planes(4)


def test_admission_plan_budget():
    plan = AdmissionPlan(
        required_blocks=8, reserved_growth_blocks=3, headroom_blocks=2, cached_claim_blocks=1
    )
    assert plan.total_cost_blocks == 14
    assert plan.fits(14) and not plan.fits(13)


def test_runner_output_round_trips_through_msgpack():
    identity = ExecutionIdentity("a", 3)
    generated = GeneratedTokens(
        identity=identity,
        first_output_index=2,
        token_ids=(42, 7),
        exit_depths=(3, 4),
        logprobs=(-0.5, -1.0),
        top_logprobs=(((42, -0.5),), ()),
    )
    out = ModelRunnerOutput(step_id=9, generated=(generated,), decode_ticks=8, loop_slots=32)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ModelRunnerOutput) == out
    assert not SchedulerOutput(step_id=1).has_work
    assert SchedulerOutput(step_id=2, decode_ticks=1).has_work


def test_prompt_exit_depths_round_trip_and_default_to_full_depth():
    """Exit-depth scoring (0.1.11): the request flag, the runner's per-token depths and the
    delta's per-prompt-token depths are optional and survive msgpack."""
    params = SamplingParams(prompt_logprobs=1, score_at_exit_depth=True)
    assert not SamplingParams(prompt_logprobs=1).score_at_exit_depth
    scores = PromptLogprobs(ExecutionIdentity("a", 0), 1, (-0.5,), (1,), (((3, -0.5),),), (2,))
    delta = RequestOutputDelta(
        request_id="a",
        token_ids=(5,),
        exit_depths=(2,),
        prompt_logprobs=(None, -0.5),
        prompt_exit_depths=(None, 2),
    )
    for value, kind in ((params, SamplingParams), (scores, PromptLogprobs)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=kind) == value
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(delta), type=RequestOutputDelta) == delta
    assert PromptLogprobs(scores.identity, 1, (-0.5,), (1,), ((),)).exit_depths == ()
    assert (
        RequestOutputDelta(request_id="a", token_ids=(5,), exit_depths=(4,)).prompt_exit_depths
        is None
    )


def test_decode_rule_round_trips_and_bounds_tokens_per_tick():
    hazard = ExitRule(ExitRuleKind.HAZARD, min_loops=2, max_loops=4, threshold=0.5)
    fixed = ExitRule(ExitRuleKind.HAZARD, min_loops=2, max_loops=4, threshold=1.0)
    trace = ExitRule(ExitRuleKind.TRACE, 1, 4, trace_depths=(4, 3, 2, 4))
    assert hazard.uses_gate and not fixed.uses_gate and not trace.uses_gate
    assert (hazard.min_exit_depth, fixed.min_exit_depth, trace.min_exit_depth) == (2, 4, 2)
    data = NewRequestData(
        ExecutionIdentity("r", 0), SamplingParams(seed=1), 5, DecodeRule(trace, 4, (0,))
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(data), type=NewRequestData) == data


def test_configuration_error_names_all_options():
    err = ConfigurationError(("enable_prefix_caching", "kv_layout"), "needs last_exited")
    assert err.options == ("enable_prefix_caching", "kv_layout")
    assert "enable_prefix_caching + kv_layout" in str(err)


def test_request_timings_intervals_and_backward_compatible_deltas():
    timings = RequestTimings(queued=1.0, scheduled=1.5, first_token=2.25, last_token=4.0)
    assert (timings.queue_time, timings.prefill_time) == (0.5, 0.75)
    assert (timings.decode_time, timings.inference_time) == (1.75, 2.5)
    waiting = RequestTimings(queued=1.0)
    assert waiting.queue_time is waiting.prefill_time is waiting.inference_time is None
    delta = RequestOutputDelta(
        request_id="r", token_ids=(5,), exit_depths=(4,), finished=True, timings=timings
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(delta), type=RequestOutputDelta) == delta
    old = RequestOutputDelta(
        request_id="r", token_ids=(5,), exit_depths=(4,)
    )  # engines that record no timings
    assert old.timings is None
    assert msgspec.json.decode(msgspec.json.encode(old), type=RequestOutputDelta) == old


def test_token_columns_are_declared_once_and_copied_by_name():
    """The per-token columns (0.2.0): both messages carry exactly TokenColumns' fields, and a
    TokenLog copies every column by name, keeping optional ones only where asked for."""
    for message in (GeneratedTokens, RequestOutputDelta):
        assert message.__struct_fields__[: len(COLUMNS)] == COLUMNS
    assert OPTIONAL_COLUMNS == {"logprobs", "top_logprobs"}
    assert requested_columns(SamplingParams()) == frozenset()
    assert requested_columns(SamplingParams(logprobs=0)) == OPTIONAL_COLUMNS
    delta = RequestOutputDelta(
        request_id="r",
        token_ids=(5, 6, 7),
        exit_depths=(4, 2, 3),
        logprobs=(-0.1, -0.2, -0.3),
        top_logprobs=(((5, -0.1),), ((6, -0.2),), ((7, -0.3),)),
    )
    plain, scored = TokenLog.for_request(SamplingParams()), TokenLog(OPTIONAL_COLUMNS)
    for log in (plain, scored):
        log.extend(delta, 1)
        log.extend(delta, 0, 1)
        assert len(log) == 3 and log.token_ids == [6, 7, 5] and log.exit_depths == [2, 3, 4]
    assert plain.logprobs is None and plain.since(1)["logprobs"] is None
    assert scored.since(2) == {
        "token_ids": (5,),
        "exit_depths": (4,),
        "logprobs": (-0.1,),
        "top_logprobs": (((5, -0.1),),),
    }
    assert columns_of(delta, 0, 1) == scored.since(2)
    rebuilt = RequestOutputDelta(request_id="r", **scored.since())
    assert rebuilt.top_logprobs == (((6, -0.2),), ((7, -0.3),), ((5, -0.1),))
    # a delta without the optional columns keeps a log that has them aligned (None entries)
    scored.extend(RequestOutputDelta(request_id="r", token_ids=(9,), exit_depths=(1,)))
    assert scored.logprobs[-1] is None and len(scored.top_logprobs) == 4
    with pytest.raises(ValueError, match="not optional"):
        TokenLog({"exit_depths"})

    class Holder(TokenLogColumns):
        def __init__(self, tokens: TokenLog) -> None:
            self.tokens = tokens

    holder = Holder(scored)
    assert all(getattr(holder, name) is getattr(scored, name) for name in COLUMNS)
