"""Prompt progress is reported with completion evidence only (R18): submission queues it, the
step's completion (an event on CUDA, synchronous execution on the CPU) establishes it, and a
step without evidence or a failed step reports none."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import ExecutionFailure, ExecutionIdentity, FailedOperation, PrefillProgress
from rlt_runner.readback import PendingStep, StepCompletion, finish_readback, start_readback

CHUNK = PrefillProgress(ExecutionIdentity("p", 0), 8)
RING = torch.zeros(4, 2, 2, dtype=torch.float64)


class RecordingEvent:
    """Stands in for a CUDA event: remembers whether the host waited on it."""

    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


def test_a_prefill_only_cpu_step_reports_progress_because_the_cpu_ran_it_synchronously():
    pending = PendingStep(3, queued_progress=(CHUNK,))
    start_readback(pending, None, RING, torch.device("cpu"))  # nothing to read back
    assert pending.host is None and pending.event is None
    assert pending.completion is StepCompletion.SYNCHRONOUS
    output, _ = finish_readback(pending)
    assert output.prefill_progress == (CHUNK,) and output.generated == ()


def test_event_evidence_is_waited_on_before_progress_is_reported():
    event = RecordingEvent()
    pending = PendingStep(4, queued_progress=(CHUNK,), event=event, completion=StepCompletion.EVENT)
    output, _ = finish_readback(pending)
    assert event.synchronized and output.prefill_progress == (CHUNK,)


def test_queued_progress_without_evidence_is_an_error_not_a_report():
    pending = PendingStep(5, queued_progress=(CHUNK,))  # submit never established completion
    with pytest.raises(RuntimeError, match="no completion evidence"):
        finish_readback(pending)
    claimed = PendingStep(6, queued_progress=(CHUNK,), completion=StepCompletion.EVENT)
    with pytest.raises(RuntimeError, match="no completion evidence"):
        finish_readback(claimed)  # an event was promised but none was recorded


def test_a_failed_step_reports_its_failures_and_no_progress():
    failure = ExecutionFailure((CHUNK.identity,), "RuntimeError: fault", FailedOperation.STEP)
    pending = PendingStep(7, queued_progress=(CHUNK,), failures=[failure], step_failed=True)
    output, _ = finish_readback(pending)
    assert output.failures == (failure,) and output.step_failed
    assert output.prefill_progress == () and output.generated == ()


def test_a_request_failure_leaves_the_other_results_of_the_step():
    failure = ExecutionFailure(
        (ExecutionIdentity("v", 1),), "preemption snapshot failed", FailedOperation.SNAPSHOT
    )
    pending = PendingStep(8, queued_progress=(CHUNK,), failures=[failure])
    start_readback(pending, None, RING, torch.device("cpu"))
    output, _ = finish_readback(pending)
    assert output.failures == (failure,) and not output.step_failed
    assert output.prefill_progress == (CHUNK,)
