"""The waiting-queue limit counts what really waits: requests a step left waiting, plus those
queued since beyond the free runner slots. Batches are queued all or none, and stop token ids
are checked against the vocabulary."""

from __future__ import annotations

import pytest
from rlt_contracts import EngineRequest, InvalidRequestError, OverloadedError, SamplingParams
from scheduler_harness import make_scheduler


def requests(prefix: str, count: int) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", (1, 2, 3), SamplingParams()) for i in range(count)]


def test_requests_that_free_slots_will_take_do_not_count_as_waiting():
    scheduler = make_scheduler(max_num_seqs=8, max_waiting_requests=2)
    # Idle: 8 free slots take 8 of these at the next step; only the last 2 really wait.
    for request in requests("r", 10):
        scheduler.add_request(request.request_id, request.prompt_token_ids, request.sampling)
    with pytest.raises(OverloadedError):
        scheduler.add_request("one-too-many", (1, 2), SamplingParams())
    assert scheduler.num_waiting == 10

    scheduler.schedule()  # admits 8: every slot is taken, 2 really wait
    assert (scheduler.num_running, scheduler.num_waiting) == (8, 2)
    with pytest.raises(OverloadedError):
        scheduler.add_request("late", (1, 2), SamplingParams())
    scheduler.abort_request("r0")
    scheduler.schedule()  # the freed slot takes r8: one request waits now
    assert (scheduler.num_running, scheduler.num_waiting) == (8, 1)
    scheduler.add_request("late", (1, 2), SamplingParams())
    with pytest.raises(OverloadedError):
        scheduler.add_request("later", (1, 2), SamplingParams())


def test_requests_a_step_left_waiting_for_kv_count_although_slots_are_free():
    # 40 blocks of 4 tokens x 4 planes: one request of 3 + 32 - 1 positions fits at a time
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=8, max_waiting_requests=2)
    long = SamplingParams(max_tokens=32)
    for i in range(3):
        scheduler.add_request(f"r{i}", (1, 2, 3), long)
    scheduler.schedule()
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 2)
    with pytest.raises(OverloadedError):  # 7 slots are free, but 2 requests could not start
        scheduler.add_request("late", (1, 2, 3), long)


def test_a_batch_is_queued_all_or_none():
    scheduler = make_scheduler(max_num_seqs=8, max_waiting_requests=2)
    scheduler.add_requests(requests("a", 4))
    with pytest.raises(OverloadedError):  # 4 + 7 = 11 > 8 slots + 2 waiting
        scheduler.add_requests(requests("b", 7))
    assert scheduler.waiting_request_ids() == ["a0", "a1", "a2", "a3"]

    bad = [*requests("c", 3), EngineRequest("c-bad", (1, 5000), SamplingParams())]
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_requests(bad)
    assert error.value.field == "prompt"
    duplicated = [*requests("d", 2), *requests("d", 1)]
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_requests(duplicated)
    assert error.value.field == "request_id"
    assert scheduler.num_waiting == 4

    added = scheduler.add_requests(requests("e", 6))  # exactly fills slots + limit
    assert [r.identity.request_id for r in added] == [f"e{i}" for i in range(6)]
    assert scheduler.num_waiting == 10


def test_a_batch_larger_than_the_queue_and_every_slot_is_invalid_not_overloaded():
    scheduler = make_scheduler(max_num_seqs=8, max_waiting_requests=2)
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_requests(requests("r", 11))
    assert error.value.field == "prompt"
    assert scheduler.num_waiting == 0


def test_stop_token_ids_outside_the_vocabulary_are_rejected():
    scheduler = make_scheduler()  # vocabulary of 1000
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request("r", (1, 2), SamplingParams(stop_token_ids=(5, 1000)))
    assert error.value.field == "stop_token_ids"
    assert scheduler.num_waiting == 0
    scheduler.add_request("r", (1, 2), SamplingParams(stop_token_ids=(5, 999)))


def test_an_admission_round_sums_the_running_growth_once_per_admission(monkeypatch):
    """The reserved growth of the running requests is O(running): a round computes it once,
    and again only after it admitted someone, not once per waiting request it examines (with
    64 running and 64 waiting under KV pressure that was most of a step's host time)."""
    from rlt_scheduler import admitter

    calls = []
    growth = admitter.running_growth
    monkeypatch.setattr(admitter, "running_growth", lambda *a: calls.append(1) or growth(*a))
    # 40 blocks of 4 tokens x 4 planes: one request of 3 + 32 - 1 positions fits at a time
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=8, max_waiting_requests=20)
    for i in range(10):
        scheduler.add_request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=32))
    scheduler.schedule()  # admits r0, then examines r1..r9: none fits
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 9)
    # the tick policy's probe (can r0 start?), the round before r0, once after admitting it
    assert len(calls) == 3
    calls.clear()
    scheduler.schedule()  # nothing fits: the probe's sum and at most one for the round
    assert len(calls) <= 2 and scheduler.num_waiting == 9
