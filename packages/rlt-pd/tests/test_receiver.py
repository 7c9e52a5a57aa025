"""KVReceiver over the scripted fake transport: activation evidence, stale messages, cancel ->
drained -> release, lease expiry, wait timeout, P's abort, protocol violations."""

from __future__ import annotations

import itertools

import pytest
from fake_transport import FakeNetwork
from rlt_contracts.pd import HandoffTarget
from rlt_pd import (
    Cancel,
    Commit,
    Drained,
    HandoffProtocolError,
    KVReceiver,
    KVRegion,
    Landed,
    ReceiveEvent,
    ReceiveOutcome,
    ReceiverConfig,
    encode_message,
)

REGION = KVRegion.contiguous(
    num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype_bytes=2
)
COMPLETED, FAILED, RELEASED = ReceiveOutcome


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(config=None):
    net = FakeNetwork()
    net.add("P", REGION)
    d = net.add("D", REGION)
    net.connect("P", "D")
    clock = Clock()
    receiver = KVReceiver(d, config, clock=clock)
    receiver.expect(HandoffTarget("t1", "D", ((0, 1),), 0, 0, 8), "P")
    return d, receiver, clock


def deliver(d, *messages, peer="P"):
    d.inbox.extend((peer, encode_message(m)) for m in messages)


@pytest.mark.parametrize(
    "order", list(itertools.permutations([Landed("t1", 0), Landed("t1", 1), Commit("t1", 2)]))
)
def test_completes_only_with_commit_and_every_sequence_in_any_order(order):
    d, receiver, _ = setup()
    for message in order[:-1]:
        deliver(d, message)
        assert receiver.poll() == []
    deliver(d, order[-1])
    assert receiver.poll() == [ReceiveEvent("t1", COMPLETED)]
    assert receiver.transfers == () and receiver.tracker("t1") is None
    deliver(d, Landed("t1", 1), Drained("t1"))  # late duplicates of a finished transfer: stale
    assert receiver.poll() == []


def test_unknown_ids_and_other_agents_are_stale():
    d, receiver, _ = setup()
    deliver(d, Landed("other", 0), Commit("other", 1), Drained("other"))
    deliver(d, Landed("t1", 0), Commit("t1", 1), peer="P2")  # same id, another prefill agent
    assert receiver.poll() == []
    assert receiver.tracker("t1").arrived_count == 0


def test_cancel_holds_blocks_until_drained():
    d, receiver, clock = setup()
    deliver(d, Landed("t1", 0))
    receiver.poll()
    assert receiver.cancel("t1") and receiver.cancel("t1")  # idempotent
    assert d.sent == [("P", Cancel("t1"))]
    deliver(d, Landed("t1", 1), Commit("t1", 2))  # writes P had in flight still land ...
    assert receiver.poll() == []  # ... but never activate, and the blocks stay held
    clock.now = 100
    deliver(d, Drained("t1"))
    assert receiver.poll() == [ReceiveEvent("t1", RELEASED, "prefill side drained")]
    assert receiver.cancel("t1") is False


def test_lease_expiry_releases_without_drained():
    d, receiver, clock = setup(ReceiverConfig(lease_s=30))
    clock.now = 5
    receiver.cancel("t1")
    clock.now = 34
    assert receiver.poll() == []
    clock.now = 35
    [event] = receiver.poll()
    assert event.outcome is RELEASED and "lease of 30 s expired" in event.message


def test_wait_timeout_fails_then_cancels_and_releases_on_drained():
    d, receiver, clock = setup(ReceiverConfig(wait_timeout_s=10, lease_s=30))
    deliver(d, Landed("t1", 0), Commit("t1", 3))
    clock.now = 9
    assert receiver.poll() == []
    clock.now = 10
    [event] = receiver.poll()
    assert event.outcome is FAILED and "1 of 3 partitions arrived" in event.message
    assert d.sent == [("P", Cancel("t1"))]
    assert receiver.poll() == []  # failed once; blocks held
    deliver(d, Drained("t1"))
    assert [e.outcome for e in receiver.poll()] == [RELEASED]


def test_drained_before_completion_means_prefill_gave_up():
    d, receiver, _ = setup()
    deliver(d, Landed("t1", 0), Drained("t1"))
    events = receiver.poll()
    assert [e.outcome for e in events] == [FAILED, RELEASED]
    assert "aborted" in events[0].message
    assert d.sent == []  # P already drained: no cancel needed


def test_completion_wins_over_drained_in_the_same_batch():
    d, receiver, _ = setup()
    deliver(d, Landed("t1", 0), Commit("t1", 1), Drained("t1"))
    assert receiver.poll() == [ReceiveEvent("t1", COMPLETED)]


def test_cancel_that_cannot_be_sent_still_releases_at_lease_end():
    d, receiver, clock = setup(ReceiverConfig(lease_s=1))
    d.refuse_sends = True
    receiver.cancel("t1")
    clock.now = 1
    assert [e.outcome for e in receiver.poll()] == [RELEASED]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([Commit("t1", 2), Landed("t1", 2)], "outside"),
        ([Commit("t1", 2), Commit("t1", 3)], "after commit"),
        ([Landed("t1", 4), Commit("t1", 2)], "already arrived"),
        ([Cancel("t1")], "decode side got"),
    ],
)
def test_protocol_violations_raise(messages, match):
    d, receiver, _ = setup()
    deliver(d, *messages)
    with pytest.raises(HandoffProtocolError, match=match):
        receiver.poll()


def test_undecodable_notification_raises():
    d, receiver, _ = setup()
    d.inbox.append(("P", b"not msgpack \xc1"))
    with pytest.raises(HandoffProtocolError, match="undecodable"):
        receiver.poll()


def test_expect_twice_raises():
    _, receiver, _ = setup()
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect(HandoffTarget("t1", "D", ((2,),), 0, 1, 4), "P")
