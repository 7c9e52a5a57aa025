"""ReceiveTracker: completion needs commit AND every sequence; stale, duplicate and cancellation."""

from __future__ import annotations

import itertools

import pytest
from rlt_contracts import ExecutionIdentity
from rlt_pd import Delivery, HandoffProtocolError, ReceiveTracker

ME = ExecutionIdentity("req", 7)
REUSED_ID = ExecutionIdentity("req", 6)  # an earlier, cancelled admission of the same request id


@pytest.mark.parametrize("order", list(itertools.permutations(["c", 0, 1, 2])))
def test_complete_only_after_commit_and_every_sequence_in_any_order(order):
    tracker = ReceiveTracker(ME)
    for step, message in enumerate(order):
        assert not tracker.complete
        if message == "c":
            assert tracker.commit(ME, 3) is Delivery.ACCEPTED
        else:
            assert tracker.record(ME, message) is Delivery.ACCEPTED
        assert tracker.complete == (step == len(order) - 1)
    assert tracker.missing() == () and tracker.arrived_count == 3


def test_commit_alone_is_not_completion():
    tracker = ReceiveTracker(ME)
    assert tracker.missing() is None
    tracker.commit(ME, 2)
    assert not tracker.complete and tracker.missing() == (0, 1)
    tracker.record(ME, 1)
    assert not tracker.complete and tracker.missing() == (0,)
    tracker.record(ME, 0)
    assert tracker.complete


def test_all_arrivals_without_commit_are_not_completion():
    tracker = ReceiveTracker(ME)
    for sequence in range(4):
        tracker.record(ME, sequence)
    assert not tracker.complete and tracker.commit_count is None
    tracker.commit(ME, 4)
    assert tracker.complete


def test_duplicates_change_nothing():
    tracker = ReceiveTracker(ME)
    assert tracker.record(ME, 0) is Delivery.ACCEPTED
    assert tracker.record(ME, 0) is Delivery.DUPLICATE
    assert tracker.commit(ME, 2) is Delivery.ACCEPTED
    assert tracker.commit(ME, 2) is Delivery.DUPLICATE
    assert tracker.arrived_count == 1 and not tracker.complete


def test_stale_identity_is_dropped_without_effect():
    tracker = ReceiveTracker(ME)
    assert tracker.record(REUSED_ID, 0) is Delivery.STALE
    assert tracker.commit(REUSED_ID, 1) is Delivery.STALE
    assert tracker.confirm_drained(REUSED_ID) is Delivery.STALE
    assert tracker.record(ExecutionIdentity("other", 7), 0) is Delivery.STALE
    assert tracker.arrived_count == 0 and tracker.commit_count is None
    tracker.cancel()
    assert not tracker.safe_to_release  # the stale drain confirmation did not count
    # a stale message is dropped even when it would be a protocol violation for ME
    assert tracker.record(REUSED_ID, 99) is Delivery.STALE


def test_out_of_range_sequences_and_conflicting_commits_are_protocol_errors():
    tracker = ReceiveTracker(ME)
    with pytest.raises(HandoffProtocolError, match="sequence -1"):
        tracker.record(ME, -1)
    tracker.record(ME, 2)
    with pytest.raises(HandoffProtocolError, match=r"sequences \[2\] already arrived"):
        tracker.commit(ME, 2)
    with pytest.raises(HandoffProtocolError, match="count must be >= 1"):
        tracker.commit(ME, 0)
    assert tracker.commit_count is None  # refused commits change nothing
    tracker.commit(ME, 3)
    with pytest.raises(HandoffProtocolError, match=r"sequence 3 outside \[0, 3\)"):
        tracker.record(ME, 3)
    with pytest.raises(HandoffProtocolError, match=r"commit\(4\) after commit\(3\)"):
        tracker.commit(ME, 4)
    assert isinstance(HandoffProtocolError("x"), RuntimeError)


def test_cancel_blocks_activation_and_release_waits_for_drain():
    tracker = ReceiveTracker(ME)
    tracker.commit(ME, 2)
    tracker.record(ME, 0)
    tracker.cancel()
    assert tracker.cancelled and not tracker.safe_to_release
    # P may still write after D cancelled: arrivals are accepted but never activate
    assert tracker.record(ME, 1) is Delivery.ACCEPTED
    assert not tracker.complete and not tracker.safe_to_release
    assert tracker.confirm_drained(ME) is Delivery.ACCEPTED
    assert tracker.safe_to_release and not tracker.complete
    assert tracker.confirm_drained(ME) is Delivery.DUPLICATE
    tracker.cancel()  # idempotent
    assert tracker.safe_to_release


def test_cancel_after_all_data_arrived_still_waits_for_drain():
    tracker = ReceiveTracker(ME)
    tracker.record(ME, 0)
    tracker.commit(ME, 1)
    assert tracker.complete
    tracker.cancel()
    assert not tracker.complete and not tracker.safe_to_release


def test_drain_confirmed_before_cancel_releases_at_cancel():
    tracker = ReceiveTracker(ME)
    tracker.confirm_drained(ME)  # e.g. the coordinator: P never started writing
    assert not tracker.safe_to_release  # not cancelled: the pages belong to the admission
    tracker.cancel()
    assert tracker.safe_to_release
