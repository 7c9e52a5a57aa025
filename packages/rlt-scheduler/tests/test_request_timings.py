"""Per-request lifecycle timestamps: taken on the host monotonic clock, reported once, on the
final delta (`RequestTimings`)."""

from __future__ import annotations

import itertools

import pytest
import rlt_scheduler.scheduler as scheduler_module
from rlt_contracts import FinishReason, SamplingParams
from scheduler_harness import FakeDevice, make_scheduler, run_until_idle


class TickingClock:
    """Stands in for the `time` module: every monotonic() call is one second later."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)

    def monotonic(self) -> float:
        return float(next(self._ticks))


@pytest.fixture
def clock(monkeypatch):
    clock = TickingClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    return clock


@pytest.mark.parametrize("in_flight", [0, 1])
def test_final_delta_carries_ordered_timings(clock, in_flight):
    scheduler = make_scheduler(max_num_seqs=1)  # b waits for a: a real queue time
    for request_id in ("a", "b"):
        scheduler.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    device = FakeDevice(scheduler.kv, depth=lambda rid, i: 2)
    _, finals = run_until_idle(scheduler, device, in_flight=in_flight)
    timings = {}
    for request_id, deltas in finals.items():
        assert [d.timings is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert sum(len(d.token_ids) for d in deltas) == 5
        timings[request_id] = deltas[-1].timings
    for t in timings.values():
        assert t.queued < t.scheduled < t.first_token < t.last_token
        assert t.inference_time == t.prefill_time + t.decode_time
        assert t.queue_time == t.scheduled - t.queued
    a, b = timings["a"], timings["b"]
    assert a.queued < b.queued and b.scheduled > a.last_token  # admitted once a finished
    assert b.queue_time > a.queue_time


def test_a_request_aborted_while_waiting_has_only_its_queue_stamp(clock):
    scheduler = make_scheduler()
    scheduler.add_request("x", [1, 2], SamplingParams(max_tokens=4))
    scheduler.abort_request("x")
    [delta] = scheduler.take_outputs()
    assert delta.finish_reason is FinishReason.ABORT
    t = delta.timings
    assert t.queued == 1.0 and t.scheduled is t.first_token is t.last_token is None
    assert t.queue_time is t.prefill_time is t.decode_time is t.inference_time is None
