"""KVSender over the scripted fake transport: sequence numbers across chunks, commit only after
everything is posted, bounded in-flight bytes, readiness gating, failures, cancel -> drained,
write leases, stale and unknown ids, protocol violations."""

from __future__ import annotations

import pytest
from fake_transport import FakeNetwork, decoded
from rlt_contracts.pd import HandoffTarget
from rlt_pd import (
    Cancel,
    Commit,
    Drained,
    HandoffProtocolError,
    KVRegion,
    KVSender,
    Landed,
    PDTransportError,
    SenderConfig,
    SendEvent,
    SendOutcome,
    encode_message,
)

# 2 layers, B = 4, one token of one layer of one tensor = 4 bytes, a block = 16 bytes
REGION = KVRegion.contiguous(
    num_layers=2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=2, dtype_bytes=2,
    allocated_blocks=17,
)  # fmt: skip
SRC = [[0, 1, 2], [3, 4, 5]]  # P's tables, 2 planes
DST = ((10, 11, 12), (13, 14, 15))  # D's tables


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def target(tid="t1", prompt=10, first=0, decode="D"):
    return HandoffTarget(tid, decode, DST, first, 2, prompt)


def setup(config=None, **kwargs):
    net = FakeNetwork()
    p = net.add("P", REGION)
    d = net.add("D", REGION)
    net.connect("P", "D")
    clock = Clock()
    return net, p, d, KVSender(p, config, clock=clock, **kwargs), clock


def kinds(messages):
    return [type(m).__name__ for m in messages]


def test_chunks_continue_sequence_numbers_and_commit_follows_the_final_chunk():
    net, p, d, sender, _ = setup()
    assert sender.start(target())
    assert sender.send_chunk("t1", SRC, 0, 4)  # page 0, full
    assert sender.send_chunk("t1", SRC, 4, 8)  # page 1, full
    assert p.sent == []  # no commit before the final chunk
    assert sender.send_chunk("t1", SRC, 8, 10, final_hidden_row=3)  # 2 tokens of page 2
    notes = [w.notification for w in net.writes]
    assert notes == [Landed("t1", 0), Landed("t1", 1), Landed("t1", 2)]
    assert [w.hidden_rows for w in net.writes] == [None, None, (3, 2)]
    # one partition per chunk: K/V x 2 layers x 2 planes
    assert [w.partition.kv_bytes for w in net.writes] == [128, 128, 64]
    assert p.sent == [("D", Commit("t1", 3))]  # posted everything: commit, not yet DONE
    assert sender.poll() == []
    net.complete_all()
    assert sender.poll() == [SendEvent("t1", SendOutcome.DONE)]
    assert sender.transfers == () and sender.inflight_bytes == 0
    assert decoded(d.inbox) == [Commit("t1", 3), Landed("t1", 0), Landed("t1", 1), Landed("t1", 2)]


def test_positions_below_first_token_are_skipped_and_empty_chunks_post_nothing():
    net, p, _, sender, _ = setup()
    sender.start(target(first=6))
    sender.send_chunk("t1", SRC, 0, 4)  # entirely cached on D
    assert net.writes == []
    sender.send_chunk("t1", SRC, 4, 8)  # positions 6, 7 only
    sender.send_chunk("t1", SRC, 8, 10, final_hidden_row=0)
    assert [(w.notification.sequence, w.partition.kv_bytes) for w in net.writes] == [
        (0, 2 * 2 * 2 * 2 * 4),  # 2 tokens x 2 planes x 2 layers x K/V x 4 bytes
        (1, 2 * 2 * 2 * 2 * 4),
    ]
    first = net.writes[0].partition.descriptors[0]
    assert first.destination_offset_bytes == 11 * 16 + 2 * 4  # D block 11, token 2
    assert p.sent == [("D", Commit("t1", 2))]


def test_fully_cached_prompt_sends_only_the_hidden_state():
    net, p, _, sender, _ = setup()
    sender.start(target(prompt=8, first=8))
    sender.send_chunk("t1", SRC, 0, 8, final_hidden_row=1)
    [write] = net.writes
    assert write.partition.descriptors == () and write.hidden_rows == (1, 2)
    assert p.sent == [("D", Commit("t1", 1))]


def test_inflight_bytes_are_bounded_and_the_commit_waits_for_the_last_post():
    config = SenderConfig(max_inflight_bytes=64, transfer_chunk_bytes=64)
    net, p, _, sender, _ = setup(config)
    sender.start(target(prompt=12))
    sender.send_chunk("t1", SRC, 0, 8)  # 256 bytes -> 4 partitions of 64
    assert len(net.writes) == 1 and sender.inflight_bytes == 64
    assert sender.queued_partitions == 3
    sender.send_chunk("t1", SRC, 8, 12, final_hidden_row=0)
    assert len(net.writes) == 1 and p.sent == []
    posted = 1
    while net.pending():
        [pending] = net.pending()  # never more than the bound allows
        net.complete(pending.handle)
        assert sender.poll() == [] or not net.pending()
        assert sender.inflight_bytes <= 64
        posted = len(net.writes)
        if sender.queued_partitions:
            assert p.sent == []
    assert posted == 6 + 1  # 8 + 4 tokens: 384 bytes in 64-byte partitions, + the hidden state
    assert [w.notification.sequence for w in net.writes] == list(range(7))
    assert p.sent == [("D", Commit("t1", 7))]


def test_one_partition_goes_even_when_it_alone_exceeds_what_is_left():
    config = SenderConfig(max_inflight_bytes=100, transfer_chunk_bytes=64)
    net, _, _, sender, _ = setup(config)
    sender.start(target(prompt=12))
    sender.send_chunk("t1", SRC, 0, 8)
    assert [w.partition.total_bytes for w in net.writes] == [64]  # 64 + 64 > 100


def test_fifo_across_transfers_and_commit_of_a_finished_one_is_not_held_back():
    config = SenderConfig(max_inflight_bytes=128, transfer_chunk_bytes=128)
    net, p, _, sender, _ = setup(config)
    sender.start(target("a", prompt=4))
    sender.start(HandoffTarget("b", "D", ((1,), (2,)), 0, 1, 4))
    sender.send_chunk("a", SRC, 0, 4, final_hidden_row=0)  # 128 + hidden 8 -> 2 partitions
    sender.send_chunk("b", [[6], [7]], 0, 4, final_hidden_row=1)
    assert [w.notification for w in net.writes] == [Landed("a", 0)]
    net.complete(net.writes[0].handle)
    sender.poll()
    assert [w.notification for w in net.writes][1:] == [Landed("a", 1)]
    assert p.sent == [("D", Commit("a", 2))]
    net.complete(net.writes[1].handle)
    assert sender.poll() == [SendEvent("a", SendOutcome.DONE)]
    assert [w.notification.transfer_id for w in net.writes[2:]] == ["b"]


def test_partitions_wait_for_the_chunk_event_and_keep_their_order():
    net, p, _, sender, _ = setup()
    events = {"c0": False, "c1": True}
    sender.start(target(prompt=8))
    sender.send_chunk("t1", SRC, 0, 4, ready=lambda: events["c0"])
    sender.send_chunk("t1", SRC, 4, 8, final_hidden_row=0, ready=lambda: events["c1"])
    assert net.writes == [] and p.sent == []  # chunk 1 is ready but waits behind chunk 0
    sender.poll()
    assert net.writes == []
    events["c0"] = True
    sender.poll()
    assert [w.notification.sequence for w in net.writes] == [0, 1]
    assert p.sent == [("D", Commit("t1", 2))]


def test_a_failing_readiness_check_fails_the_transfer():
    net, p, _, sender, _ = setup()

    def broken():
        raise RuntimeError("device-side assert")

    sender.start(target(prompt=4))
    sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=0, ready=broken)
    [event] = sender.poll()
    assert event.outcome is SendOutcome.FAILED and "device-side assert" in event.message
    assert net.writes == [] and p.sent_messages() == [Drained("t1")]


def test_write_failure_stops_posting_and_reports_after_inflight_writes_finish():
    config = SenderConfig(max_inflight_bytes=128, transfer_chunk_bytes=64)
    net, p, _, sender, _ = setup(config)
    sender.start(target(prompt=12))
    sender.send_chunk("t1", SRC, 0, 12, final_hidden_row=0)
    first, second = net.pending()
    net.fail(first.handle, "NIXL reported ERR")
    assert sender.poll() == []  # the second write is still in flight: P must keep its blocks
    assert p.sent == [] and len(net.writes) == 2  # nothing more posted
    net.complete(second.handle)
    assert sender.poll() == [SendEvent("t1", SendOutcome.FAILED, "NIXL reported ERR")]
    assert p.sent_messages() == [Drained("t1")]  # no commit, ever
    assert sender.inflight_bytes == 0 and sender.queued_partitions == 0
    assert sender.send_chunk("t1", SRC, 12, 12) is False  # reported transfers ignore chunks


def test_write_to_a_disconnected_peer_fails_without_raising():
    net, p, _, sender, _ = setup()
    sender.start(target(prompt=8))
    p.connected.clear()
    sender.send_chunk("t1", SRC, 0, 4)
    [event] = sender.poll()
    assert event.outcome is SendOutcome.FAILED and "not connected" in event.message


def test_commit_that_cannot_be_sent_fails_the_transfer():
    net, p, _, sender, _ = setup()
    sender.start(target(prompt=4))
    p.refuse_sends = True
    sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=0)
    net.complete_all()
    [event] = sender.poll()
    assert event.outcome is SendOutcome.FAILED and "commit could not be sent" in event.message


@pytest.mark.parametrize("by", ["P", "D"])
def test_cancel_drains_inflight_writes_then_sends_drained(by):
    config = SenderConfig(max_inflight_bytes=64, transfer_chunk_bytes=64)
    net, p, d, sender, _ = setup(config)
    sender.start(target(prompt=12))
    sender.send_chunk("t1", SRC, 0, 8)
    [inflight] = net.pending()
    if by == "P":
        sender.cancel("t1")
    else:
        p.inbox.append(("D", encode_message(Cancel("t1"))))
    assert sender.poll() == []  # a write is still in flight
    assert sender.send_chunk("t1", SRC, 8, 12, final_hidden_row=0) is False
    net.complete(inflight.handle)
    assert sender.poll() == [SendEvent("t1", SendOutcome.CANCELLED)]
    assert len(net.writes) == 1 and sender.queued_partitions == 0
    assert p.sent_messages() == [Drained("t1")]
    assert sender.poll() == [] and sender.transfers == ()


def test_cancel_of_unknown_id_is_answered_with_drained_and_refuses_a_later_start():
    net, p, _, sender, clock = setup(SenderConfig(tombstone_s=10))
    p.inbox.append(("D", encode_message(Cancel("early"))))
    assert sender.poll() == []
    assert p.sent == [("D", Drained("early"))]
    assert sender.start(target("early")) is False  # D already released: P must not write
    assert sender.send_chunk("early", SRC, 0, 4) is False
    sender.cancel("own-abort")  # P's abort before start: also remembered
    assert sender.start(target("own-abort")) is False
    clock.now = 11
    assert sender.start(target("early"))  # tombstone expired


def test_cancel_after_done_is_answered_with_drained():
    net, p, _, sender, _ = setup()
    sender.start(target(prompt=4))
    sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=0)
    net.complete_all()
    assert sender.poll() == [SendEvent("t1", SendOutcome.DONE)]
    p.inbox.append(("D", encode_message(Cancel("t1"))))
    sender.poll()
    assert p.sent_messages() == [Commit("t1", 1), Drained("t1")]


def test_cancel_from_another_agent_is_stale():
    net, p, _, sender, _ = setup()
    net.add("D2", REGION)
    net.connect("P", "D2")
    sender.start(target(prompt=8))
    sender.send_chunk("t1", SRC, 0, 4)
    p.inbox.append(("D2", encode_message(Cancel("t1"))))
    assert sender.poll() == []
    sender.send_chunk("t1", SRC, 4, 8, final_hidden_row=0)
    net.complete_all()
    assert sender.poll() == [SendEvent("t1", SendOutcome.DONE)]


def test_write_lease_expiry_fails_without_drained():
    net, p, _, sender, clock = setup(SenderConfig(write_timeout_s=5))
    sender.start(target(prompt=4))
    sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=0)
    clock.now = 4
    assert sender.poll() == []
    clock.now = 6
    [event] = sender.poll()
    assert event.outcome is SendOutcome.FAILED and "within 5 s" in event.message
    assert p.sent_messages() == [Commit("t1", 1)]  # no drained: the write may still land
    assert sender.inflight_bytes == 0
    net.complete_all()  # a late completion is ignored
    assert sender.poll() == []


@pytest.mark.parametrize(
    "message", [encode_message(Landed("t1", 0)), encode_message(Drained("t1")), b"\xc1garbage"]
)
def test_messages_no_decode_side_sends_are_protocol_violations(message):
    _, p, _, sender, _ = setup()
    p.inbox.append(("D", message))
    with pytest.raises(HandoffProtocolError):
        sender.poll()


def test_usage_errors_raise():
    net, p, _, sender, _ = setup()
    with pytest.raises(PDTransportError, match="not connected"):
        sender.start(target(decode="nobody"))
    with pytest.raises(ValueError, match="was not started"):
        sender.send_chunk("t1", SRC, 0, 4)
    sender.start(target(prompt=8))
    with pytest.raises(ValueError, match="already started"):
        sender.start(target(prompt=8))
    with pytest.raises(ValueError, match="leaves a gap after position 0"):
        sender.send_chunk("t1", SRC, 4, 8)
    with pytest.raises(ValueError, match="exceeds prompt_length 8"):
        sender.send_chunk("t1", SRC, 0, 9)
    with pytest.raises(ValueError, match="final_hidden_row"):
        sender.send_chunk("t1", SRC, 0, 8)
    with pytest.raises(ValueError, match="final_hidden_row"):
        sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=1)
    sender.send_chunk("t1", SRC, 0, 8, final_hidden_row=1)
    with pytest.raises(ValueError, match="after the final"):
        sender.send_chunk("t1", SRC, 8, 8, final_hidden_row=1)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        SenderConfig(max_inflight_bytes=10, transfer_chunk_bytes=20)


@pytest.mark.parametrize(
    ("tables", "first", "match"),
    [
        (((10, 11), (13, 14, 15)), 0, "plane 0 has 2 destination pages, 3 needed"),
        (((10, 11, 16), (13, 14, 15)), 0, "block 16 of plane 0 is outside"),
        (((10, 11, 12), (13, 11, 15)), 0, "block 11 of plane 1 .* used twice"),
        ((), 0, "no destination block tables"),
        (DST, 11, "first_token outside"),
    ],
)
def test_targets_that_do_not_fit_d_are_refused_at_start(tables, first, match):
    _, _, _, sender, _ = setup()
    with pytest.raises(ValueError, match=match):
        sender.start(HandoffTarget("t1", "D", tables, first, 0, 10))
    # the cached prefix's pages are never written, so they are not checked
    assert sender.start(HandoffTarget("t2", "D", ((99, 11, 12),), 4, 0, 10))


def test_a_partition_the_transport_refuses_fails_the_transfer():
    net, p, _, sender, _ = setup()
    sender.start(HandoffTarget("t1", "D", DST, 0, 7, 4))  # D has 4 hidden rows

    def refuse(*args, **kwargs):
        raise ValueError("hidden rows (0, 7) outside")

    p.write = refuse
    sender.send_chunk("t1", SRC, 0, 4, final_hidden_row=0)
    [event] = sender.poll()
    assert event.outcome is SendOutcome.FAILED and "hidden rows (0, 7)" in event.message


def test_chunks_may_start_at_the_cached_prefix_and_are_never_sent_twice():
    net, _, _, sender, _ = setup()
    sender.start(target(prompt=10, first=6))
    with pytest.raises(ValueError, match="gap after position 6"):
        sender.send_chunk("t1", SRC, 7, 8)
    sender.send_chunk("t1", SRC, 6, 8)  # the engine skipped the chunks below the prefix
    sender.send_chunk("t1", SRC, 4, 8)  # already sent: nothing again
    sender.send_chunk("t1", SRC, 5, 10, final_hidden_row=0)  # overlaps: only [8, 10) goes
    written = [
        (d.tensor, d.layer, d.destination_offset_bytes, d.length_bytes)
        for w in net.writes
        for d in w.partition.descriptors
    ]
    assert len(written) == len(set(written))
    assert sum(w.partition.kv_bytes for w in net.writes) == 4 * 2 * 2 * 2 * 4  # 4 tokens
    assert [w.notification.sequence for w in net.writes] == [0, 1]
