"""Scheduler semantics on scripted gate signals (no model): exits, modes, budget, lifecycle."""

from __future__ import annotations

import pytest
from rlt_contracts import FinishReason, RequestStage, SamplingParams
from scheduler_harness import make_scheduler, run_until_idle


def all_tokens(deltas):
    return [t for d in deltas for t in d.token_ids], [e for d in deltas for e in d.exit_depths]


def test_cumulative_hazard_exits_when_cdf_reaches_threshold():
    """Hazard 0.4 every loop, threshold 0.6: CDF 0.4 after loop 1, 0.64 after loop 2 -> exit at 2.
    A constant hazard of 0.4 alone never reaches 0.6; only the accumulation does."""
    scheduler = make_scheduler()
    scheduler.add_request(
        "r", [1, 2, 3], SamplingParams(max_tokens=3, exit_threshold=0.6, min_loops=1)
    )
    _, finals = run_until_idle(scheduler, lambda rid, loop: 0.4)
    assert all_tokens(finals["r"])[1] == [4, 2, 2]


def test_min_loops_still_accumulates_hazard_and_threshold_one_is_fixed_depth():
    scheduler = make_scheduler()
    scheduler.add_request(
        "min3", [1], SamplingParams(max_tokens=3, exit_threshold=0.5, min_loops=3)
    )
    scheduler.add_request("fixed", [1], SamplingParams(max_tokens=3, exit_threshold=1.0))
    _, finals = run_until_idle(scheduler, lambda rid, loop: 0.999)
    assert all_tokens(finals["min3"])[1] == [4, 3, 3]
    assert all_tokens(finals["fixed"])[1] == [4, 4, 4]


def test_gates_are_skipped_when_no_row_needs_them():
    scheduler = make_scheduler()
    scheduler.add_request("fixed", [1, 2], SamplingParams(max_tokens=4))
    steps, _ = run_until_idle(scheduler, lambda rid, loop: 0.5)
    assert not any(s.compute_gates for s in steps)


def recurrent_batches(steps):
    return [tuple(sorted(i.identity.request_id for i in s.decode)) for s in steps if s.decode]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # refill: "fast" (exits at min_loops 2) comes back with its next token while "slow" is
        # still on its current one, and finishes its 3 tokens while "slow" is on its second
        ("refill", [("fast", "slow")] * 4 + [("slow",)] * 4),
        # no_refill: the cohort drains ("slow" alone) before both start their next token
        ("no_refill", [("fast", "slow"), ("fast", "slow"), ("slow",), ("slow",), ("fast", "slow")]),
    ],
)
def test_refill_and_no_refill_recurrent_batches(mode, expected):
    scheduler = make_scheduler(mode=mode)
    scheduler.add_request("fast", [1], SamplingParams(max_tokens=3, exit_threshold=0.0))
    scheduler.add_request("slow", [2], SamplingParams(max_tokens=3, exit_threshold=1.0))
    steps, finals = run_until_idle(scheduler, lambda rid, loop: 0.5)
    assert recurrent_batches(steps)[: len(expected)] == expected
    assert all_tokens(finals["fast"])[1] == [4, 2, 2]
    assert all_tokens(finals["slow"])[1] == [4, 4, 4]


def test_budget_splits_prefill_chunks_in_queue_order():
    """Budget 6, chunk 4: A (10-token prompt) gets [0, 4), B gets [0, 2), C waits."""
    scheduler = make_scheduler(max_num_batched_tokens=6, prefill_chunk_size=4, max_num_seqs=4)
    for name, length in (("A", 10), ("B", 3), ("C", 2)):
        scheduler.add_request(name, list(range(1, length + 1)), SamplingParams(max_tokens=2))
    step = scheduler.schedule()
    chunks = [(c.identity.request_id, c.start_position, c.end_position) for c in step.prefill]
    assert chunks == [("A", 0, 4), ("B", 0, 2)]
    assert scheduler.num_waiting == 1


def test_decode_rows_are_scheduled_before_prefill_and_prefill_still_progresses():
    scheduler = make_scheduler(max_num_batched_tokens=3, max_num_seqs=2, prefill_chunk_size=8)
    scheduler.add_request("short", [1], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=2))
    steps, finals = run_until_idle(scheduler, lambda rid, loop: 0.5)
    for step in steps:
        assert len(step.decode) + step.num_prefill_tokens <= 3
    # "short" decodes in every step while "long" prefills alongside with the remaining budget
    long_steps = [s for s in steps if any(c.identity.request_id == "long" for c in s.prefill)]
    assert all(any(d.identity.request_id == "short" for d in s.decode) for s in long_steps[1:])
    assert finals["long"][-1].finished


def test_eos_stop_ids_and_length_finish_reasons():
    scheduler = make_scheduler()
    scheduler.add_request("eos", [1], SamplingParams(max_tokens=5))
    scheduler.add_request("ignore", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(
        "stopid", [1], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(0,))
    )
    step = scheduler.schedule()
    from scheduler_harness import fake_execute

    scheduler.update_from_output(fake_execute(step, lambda rid, loop: 0.5, token=0))
    reasons = {d.request_id: d.finish_reason for d in scheduler.take_outputs() if d.finished}
    assert reasons == {"eos": FinishReason.STOP, "stopid": FinishReason.STOP}
    _, finals = run_until_idle(scheduler, lambda rid, loop: 0.5)
    assert finals["ignore"][-1].finish_reason is FinishReason.LENGTH


def test_late_results_after_abort_and_id_reuse_are_dropped():
    from scheduler_harness import fake_execute

    scheduler = make_scheduler()
    scheduler.add_request("x", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    step = scheduler.schedule()
    late = fake_execute(step, lambda rid, loop: 0.5, token=42)
    scheduler.abort_request("x")
    new = scheduler.add_request("x", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.update_from_output(late)  # results of the aborted generation
    assert new.output_token_ids == [] and new.stage is RequestStage.WAITING
    deltas = scheduler.take_outputs()
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT]
    assert deltas[0].token_ids == ()
    next_step = scheduler.schedule()
    assert step.new_requests[0].identity in next_step.released
    assert next_step.new_requests[0].identity == new.identity != step.new_requests[0].identity
