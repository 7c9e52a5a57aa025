"""Scheduler semantics against a scripted device (no model): decode rules, ticks per step,
budget, KV lookahead under pipelining, finish reasons and late results."""

from __future__ import annotations

import pytest
from rlt_contracts import (
    ExitRule,
    ExitRuleKind,
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    ModelRunnerOutput,
    RequestStage,
    SamplingParams,
    SchedulerConfig,
)
from rlt_scheduler import DelayedHazardExitPolicy, Scheduler, TraceExitPolicy
from rlt_scheduler.exit_policy import LoopBounds
from scheduler_harness import CountingKV, FakeDevice, make_scheduler, run_until_idle


def all_tokens(deltas):
    return [t for d in deltas for t in d.token_ids], [e for d in deltas for e in d.exit_depths]


def test_requests_carry_their_exit_policy_and_stop_conditions_as_a_decode_rule():
    scheduler = make_scheduler()
    adaptive = scheduler.add_request(
        "a", [1], SamplingParams(min_loops=1, max_loops=3, exit_threshold=0.6, max_tokens=5)
    )
    assert adaptive.rule.exit == ExitRule(ExitRuleKind.HAZARD, 1, 3, 0.6)
    assert (adaptive.rule.max_tokens, adaptive.rule.stop_token_ids) == (5, (0,))
    fixed = scheduler.add_request("f", [1], SamplingParams(ignore_eos=True, stop_token_ids=(5, 6)))
    assert fixed.rule.exit == ExitRule(ExitRuleKind.HAZARD, 2, 4, 1.0)
    assert fixed.rule.stop_token_ids == (5, 6)  # no EOS: ignore_eos
    assert not fixed.rule.exit.uses_gate and fixed.rule.exit.min_exit_depth == 4


def test_other_policies_compile_to_their_rule_kinds():
    delayed = Scheduler(
        SchedulerConfig(),
        CountingKV(100, 4, 4),
        model_depth=4,
        vocab_size=100,
        max_model_len=64,
        eos_token_ids=(0,),
        exit_policy=DelayedHazardExitPolicy(),
    )
    assert delayed.add_request("d", [1], SamplingParams()).rule.exit.kind is (
        ExitRuleKind.DELAYED_HAZARD
    )
    trace = Scheduler(
        SchedulerConfig(),
        CountingKV(100, 4, 4),
        model_depth=4,
        vocab_size=100,
        max_model_len=64,
        eos_token_ids=(0,),
        exit_policy=TraceExitPolicy({"t": [4, 2, 3, 2, 4]}, 4),
    )
    rule = trace.add_request("t", [1], SamplingParams(max_tokens=3)).rule.exit
    assert (rule.kind, rule.trace_depths, rule.min_exit_depth) == (ExitRuleKind.TRACE, (4, 2, 3), 2)


def test_a_trace_star_entry_serves_requests_it_does_not_name():
    policy = TraceExitPolicy({"t": [4, 2, 3, 2], "*": [4, 3, 3, 2]}, 4)
    bounds = LoopBounds(min_loops=2, max_loops=4, threshold=1.0)
    policy.check_request("made-up-id", bounds, 4)
    assert policy.rule("made-up-id", bounds, 3).trace_depths == (4, 3, 3)
    assert policy.rule("t", bounds, 3).trace_depths == (4, 2, 3)  # a named entry wins
    with pytest.raises(InvalidRequestError, match="no depths for request 'x'"):
        TraceExitPolicy({"t": [4, 2]}, 4).check_request("x", bounds, 2)


def test_steps_run_one_tick_while_prompts_wait_then_several():
    scheduler = make_scheduler(max_num_seqs=2, decode_ticks_per_step=8)
    for name in ("a", "b", "c"):
        scheduler.add_request(name, [1, 2], SamplingParams(max_tokens=6, ignore_eos=True))
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 4)
    steps, finals = run_until_idle(scheduler, device)
    ticks = [s.decode_ticks for s in steps if s.has_work]
    assert ticks[0] == 1  # "a" and "b" start; "c" waits for a slot
    assert max(ticks) == 8
    for name in ("a", "b", "c"):
        assert all_tokens(finals[name]) == ([7] * 6, [4] * 6)


def test_requests_waiting_for_kv_blocks_do_not_shorten_the_steps():
    """Slots are free but the pool holds one request at a time (40 blocks of 4 tokens x 4
    planes, a lifetime of 2 + 24 - 1 positions): the waiting request cannot start before the
    running one finishes, so the running one decodes in full-length steps; the step after the
    finish starts the next prompt (one tick)."""
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=4, decode_ticks_per_step=8)
    for name in ("a", "b"):
        scheduler.add_request(name, [1, 2], SamplingParams(max_tokens=24, ignore_eos=True))
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 4)
    steps, finals = run_until_idle(scheduler, device, in_flight=0)
    starts = [i for i, s in enumerate(steps) if s.new_requests]
    assert [steps[i].new_requests[0].identity.request_id for i in starts] == ["a", "b"]
    ticks_while_b_waits = [s.decode_ticks for s in steps[starts[0] + 1 : starts[1] - 1]]
    assert ticks_while_b_waits and all(t == 8 for t in ticks_while_b_waits[:-1])
    assert steps[starts[1]].decode_ticks == 1  # "b" starts in a one-tick step
    for name in ("a", "b"):
        assert all_tokens(finals[name]) == ([7] * 24, [4] * 24)
    assert scheduler.kv.capacity().free_blocks == 40


def test_refill_ticks_stop_at_what_the_longest_request_can_still_use():
    scheduler = make_scheduler(decode_ticks_per_step=8)
    scheduler.add_request("r", [1], SamplingParams(max_tokens=3, ignore_eos=True, max_loops=2))
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 2)
    steps, finals = run_until_idle(scheduler, device, in_flight=0)
    # token 0 + one tick in the prefill step; then 2 tokens x 2 loops = 4 loops, 1 already run
    assert [s.decode_ticks for s in steps] == [1, 3]
    assert all_tokens(finals["r"]) == ([7, 7, 7], [4, 2, 2])


def test_budget_splits_prefill_chunks_in_queue_order():
    """Budget 6, chunk 4: A (10-token prompt) gets [0, 4), B gets [0, 2), C waits."""
    scheduler = make_scheduler(max_num_batched_tokens=6, prefill_chunk_size=4, max_num_seqs=4)
    for name, length in (("A", 10), ("B", 3), ("C", 2)):
        scheduler.add_request(name, list(range(1, length + 1)), SamplingParams(max_tokens=2))
    step = scheduler.schedule()
    chunks = [(c.identity.request_id, c.start_position, c.end_position) for c in step.prefill]
    assert chunks == [("A", 0, 4), ("B", 0, 2)]
    assert scheduler.num_waiting == 1


def test_decoding_rows_take_budget_first_and_prefill_still_progresses():
    scheduler = make_scheduler(max_num_batched_tokens=3, max_num_seqs=2, prefill_chunk_size=8)
    scheduler.add_request("short", [1], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=2))
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 4)
    steps, finals = run_until_idle(scheduler, device)
    long_steps = [s for s in steps if any(c.identity.request_id == "long" for c in s.prefill)]
    assert len(long_steps) > 2
    for step in long_steps[1:]:  # "short" decodes beside it: 1 row + at most 2 prompt tokens
        assert step.num_prefill_tokens <= 2 and step.decode_ticks == 1
    assert finals["long"][-1].finished and finals["short"][-1].finished


@pytest.mark.parametrize("in_flight", [0, 1])
def test_blocks_cover_every_position_the_submitted_steps_reach(in_flight):
    """Incremental KV with steps in flight: the scripted device asserts every looping position
    lies inside the request's blocks, at every tick (depths vary between 1 and 4)."""
    scheduler = make_scheduler(incremental_kv=True, decode_ticks_per_step=8, max_num_seqs=3)
    for i in range(3):
        scheduler.add_request(
            f"r{i}",
            [1] * (5 + i),
            SamplingParams(max_tokens=30, ignore_eos=True, min_loops=1, exit_threshold=0.0),
        )
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 1 + (i * 7 + len(rid)) % 4)
    _, finals = run_until_idle(scheduler, device, in_flight=in_flight)
    for i in range(3):
        tokens, depths = all_tokens(finals[f"r{i}"])
        assert len(tokens) == 30 and depths[0] == 4
    assert scheduler.capacity().free_blocks == scheduler.capacity().total_blocks


def test_eos_stop_ids_and_length_finish_reasons():
    scheduler = make_scheduler()
    scheduler.add_request("eos", [1], SamplingParams(max_tokens=5))
    scheduler.add_request("ignore", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(
        "stopid", [1], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(9,))
    )
    device = FakeDevice(
        scheduler.kv,
        depth=lambda rid, i: 4,
        token=lambda rid, i: {"eos": 0, "stopid": 9}.get(rid, 0),
    )
    _, finals = run_until_idle(scheduler, device)
    reasons = {rid: deltas[-1].finish_reason for rid, deltas in finals.items()}
    assert reasons == {"eos": FinishReason.STOP, "stopid": FinishReason.STOP, "ignore": "length"}
    assert all_tokens(finals["ignore"])[0] == [0, 0, 0]


def test_results_apply_in_submission_order():
    scheduler = make_scheduler()
    scheduler.add_request("x", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert scheduler.num_submitted_steps == 2
    with pytest.raises(RuntimeError, match="expected step"):
        scheduler.update_from_output(ModelRunnerOutput(step_id=second.step_id))
    scheduler.update_from_output(ModelRunnerOutput(step_id=first.step_id))
    scheduler.update_from_output(ModelRunnerOutput(step_id=second.step_id))
    assert scheduler.num_submitted_steps == 0


def test_late_results_after_abort_and_id_reuse_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request("x", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    step = scheduler.schedule()
    old = step.new_requests[0].identity
    scheduler.abort_request("x")
    new = scheduler.add_request("x", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    late = ModelRunnerOutput(
        step_id=step.step_id,
        generated=(
            GeneratedTokens(identity=old, first_output_index=0, token_ids=(42,), exit_depths=(4,)),
        ),
    )
    scheduler.update_from_output(late)  # results of the aborted generation
    assert new.output_token_ids == [] and new.stage is RequestStage.WAITING
    deltas = scheduler.take_outputs()
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT]
    assert deltas[0].token_ids == ()
    next_step = scheduler.schedule()
    assert old in next_step.released
    assert next_step.new_requests[0].identity == new.identity != old


def test_a_gap_in_reported_outputs_is_an_error():
    scheduler = make_scheduler()
    scheduler.add_request("x", [1], SamplingParams(max_tokens=4, ignore_eos=True))
    step = scheduler.schedule()
    identity = step.new_requests[0].identity
    with pytest.raises(RuntimeError, match="output 2 reported"):
        scheduler.update_from_output(
            ModelRunnerOutput(
                step_id=step.step_id,
                generated=(
                    GeneratedTokens(
                        identity=identity, first_output_index=2, token_ids=(5,), exit_depths=(4,)
                    ),
                ),
            )
        )


@pytest.mark.parametrize("in_flight", [0, 1])
def test_decoding_requests_that_cannot_grow_are_suspended_and_resumed(in_flight):
    """A pool too small for every request's lookahead: decoding requests are preempted (a
    victim, or the request itself when nothing else can give way), resumed later, and every
    request still gets all its tokens, with the blocks covering every tick."""
    scheduler = make_scheduler(
        num_blocks=48, incremental_kv=True, enable_preemption=True, decode_ticks_per_step=8
    )
    for i in range(3):
        scheduler.add_request(
            f"r{i}",
            [1] * 6,
            SamplingParams(max_tokens=24, ignore_eos=True, min_loops=1, exit_threshold=0.0),
        )
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 1 + i % 2)
    _, finals = run_until_idle(scheduler, device, in_flight=in_flight)
    for i in range(3):
        assert len(all_tokens(finals[f"r{i}"])[0]) == 24
    assert scheduler.stats.preemptions > 0
    assert scheduler.stats.resumptions == scheduler.stats.preemptions
    assert scheduler.capacity().free_blocks == scheduler.capacity().total_blocks
