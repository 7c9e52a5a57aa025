"""The scheduler's side of the failure protocol (R04) and of prompt-progress evidence (R18),
against the scripted device: a preemption victim named in a SNAPSHOT failure is aborted with
the error and never resumed; prompt progress counts only when a completed chunk of that very
step establishes it, and only at delivery (update_from_output), not at submission."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import (
    ExecutionFailure,
    FailedOperation,
    FinishReason,
    ModelRunnerOutput,
    PrefillProgress,
    RequestStage,
    SamplingParams,
)
from scheduler_harness import FakeDevice, make_scheduler, run_until_idle


def params(max_tokens: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)


def test_a_victim_whose_snapshot_failed_is_aborted_with_the_error_and_never_resumed():
    scheduler = make_scheduler(policy="priority", enable_preemption=True, max_num_seqs=1)
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 4)
    low = scheduler.add_request("low", [1, 2, 3], params(8, priority=10))
    for _ in range(2):
        scheduler.update_from_output(device.execute(scheduler.schedule()))
    assert low.stage is RequestStage.DECODING
    scheduler.add_request("high", [4, 5], params(3, priority=-10))
    step = scheduler.schedule()
    assert step.snapshots == (low.identity,) and low.stage is RequestStage.WAITING
    result = msgspec.structs.replace(
        device.execute(step),
        failures=(
            ExecutionFailure(
                (low.identity,), "preemption snapshot failed (boom)", FailedOperation.SNAPSHOT
            ),
        ),
    )
    scheduler.update_from_output(result)
    assert low.finished and low.finish_reason is FinishReason.ABORT
    assert low.error == "preemption snapshot failed (boom)"
    assert scheduler.waiting_request_ids() == [] and low.identity in scheduler.pending_releases()
    steps, finals = run_until_idle(scheduler, device)
    assert all(low.identity not in s.restores for s in steps)
    assert steps[0].released == (low.identity,)  # the runner drops whatever it still holds
    assert finals["high"][-1].finish_reason is FinishReason.LENGTH
    assert scheduler.stats.resumptions == 0 and scheduler.stats.aborted_requests == 1
    assert scheduler.capacity().free_blocks == scheduler.capacity().total_blocks


def test_prompt_progress_counts_at_delivery_not_at_submission():
    scheduler = make_scheduler(prefill_chunk_size=4, max_num_batched_tokens=16)
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 4)
    request = scheduler.add_request("p", list(range(1, 11)), params(2))
    first = scheduler.schedule()
    second = scheduler.schedule()  # one step in flight: nothing of `first` is known yet
    assert request.scheduled_prompt_tokens == 8 and request.computed_prompt_tokens == 0
    scheduler.update_from_output(device.execute(first))
    assert request.computed_prompt_tokens == 4
    scheduler.update_from_output(device.execute(second))
    assert request.computed_prompt_tokens == 8 and scheduler.stats.prompt_tokens == 8


def test_progress_without_a_completed_chunk_of_that_step_is_rejected():
    scheduler = make_scheduler(prefill_chunk_size=4, max_num_batched_tokens=16)
    request = scheduler.add_request("p", list(range(1, 11)), params(2))
    step = scheduler.schedule()
    beyond = PrefillProgress(request.identity, 8)  # the chunk of this step ends at 4
    with pytest.raises(RuntimeError, match="none of its completed chunks"):
        scheduler.update_from_output(
            ModelRunnerOutput(step_id=step.step_id, prefill_progress=(beyond,))
        )
    assert request.computed_prompt_tokens == 0


def test_a_failed_step_reporting_progress_is_rejected():
    scheduler = make_scheduler(prefill_chunk_size=4, max_num_batched_tokens=16)
    request = scheduler.add_request("p", list(range(1, 11)), params(2))
    step = scheduler.schedule()
    with pytest.raises(RuntimeError, match="none of its completed chunks"):
        scheduler.update_from_output(
            ModelRunnerOutput(
                step_id=step.step_id,
                prefill_progress=(PrefillProgress(request.identity, 4),),
                failures=(ExecutionFailure((), "device fault"),),
            )
        )
