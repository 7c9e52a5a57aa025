"""KVSender pacing: queued partitions go as soon as finished writes make room under the
in-flight bound, not one bound's worth per `poll()` (the engine polls once per step), so
concurrent handoffs larger than the bound progress together instead of queueing for steps."""

from __future__ import annotations

from fake_transport import FakeNetwork, FakeTransport
from rlt_contracts.pd import HandoffTarget
from rlt_pd import Commit, KVRegion, KVSender, SenderConfig, SendEvent, SendOutcome

# 2 layers, B = 4, a block of one layer of one tensor = 16 bytes; 2 planes
REGION = KVRegion.contiguous(
    num_layers=2, num_blocks=64, block_size=4, num_kv_heads=1, head_dim=2, dtype_bytes=2,
    allocated_blocks=65,
)  # fmt: skip


class FinishesAtOnce(FakeTransport):
    """Writes that are complete when posting returns (UCX on host memory, CUDA IPC copies):
    the next poll of the transport reports them finished."""

    def write(self, peer, partition, notification, *, hidden_rows=None) -> int:
        handle = super().write(peer, partition, notification, hidden_rows=hidden_rows)
        self.network.complete(handle)
        return handle


def setup(config: SenderConfig, transport=FakeTransport):
    net = FakeNetwork()
    p = transport(net, "P", REGION)
    net.endpoints["P"] = p
    net.add("D", REGION)
    net.connect("P", "D")
    return net, p, KVSender(p, config)


def target(tid: str, index: int) -> HandoffTarget:
    """A 12-token prompt on 2 planes (3 pages each) in D blocks of its own."""
    base = 6 * index
    tables = (tuple(range(base, base + 3)), tuple(range(base + 3, base + 6)))
    return HandoffTarget(tid, "D", tables, 0, index, 12)


def test_a_write_that_finished_makes_room_for_the_next_chunk_without_a_poll():
    net, _, sender = setup(SenderConfig(max_inflight_bytes=64, transfer_chunk_bytes=64))
    sender.start(target("t1", 0))
    sender.send_chunk("t1", [[0, 1, 2], [3, 4, 5]], 0, 8)  # 256 bytes: 4 partitions of 64
    assert len(net.writes) == 1 and sender.queued_partitions == 3
    net.complete(net.writes[0].handle)  # finished during the next step's compute
    sender.send_chunk("t1", [[0, 1, 2], [3, 4, 5]], 8, 12, final_hidden_row=0)
    assert len(net.writes) == 2  # the finished write was accounted: the next one went
    assert sender.inflight_bytes == 64 and sender.queued_partitions == 5


def test_concurrent_handoffs_larger_than_the_bound_all_go_in_the_step_that_computed_them():
    """Four prompts finish in one step, each four times the in-flight bound. With writes that
    finish as they are posted, every partition and commit goes out during that step's
    send_chunk calls and one poll reports all four done; before, P posted one bound's worth
    per poll, so the fourth request waited for 16 engine steps behind the other three."""
    config = SenderConfig(max_inflight_bytes=64, transfer_chunk_bytes=64)
    net, p, sender = setup(config, FinishesAtOnce)
    tids = [f"t{i}" for i in range(4)]
    for i, tid in enumerate(tids):
        sender.start(target(tid, i))
    for i, tid in enumerate(tids):
        source = [[10 * i, 10 * i + 1, 10 * i + 2], [10 * i + 3, 10 * i + 4, 10 * i + 5]]
        sender.send_chunk(tid, source, 0, 12, final_hidden_row=i)
    assert sender.queued_partitions == 0
    # 384 KV bytes + 8 hidden each, in partitions of at most 64 bytes
    assert [m for _, m in p.sent] == [Commit(tid, 8) for tid in tids]
    assert len(net.writes) == 4 * 8
    assert sorted(sender.poll()) == [SendEvent(tid, SendOutcome.DONE) for tid in tids]
    assert sender.inflight_bytes == 0


def test_the_bound_still_holds_while_writes_are_in_flight():
    """Writes that have not finished keep later partitions queued (FIFO across transfers)."""
    net, _, sender = setup(SenderConfig(max_inflight_bytes=128, transfer_chunk_bytes=64))
    for i, tid in enumerate(("a", "b")):
        sender.start(target(tid, i))
        sender.send_chunk(tid, [[0, 1, 2], [3, 4, 5]], 0, 12, final_hidden_row=i)
    # a's partitions: 64, 32, 64, ... bytes: 64 + 32 posted, the next 64 would exceed 128
    assert [w.notification.transfer_id for w in net.writes] == ["a", "a"]
    assert sender.inflight_bytes == 96 and sender.queued_partitions == 6 + 8
    net.complete(net.writes[0].handle)
    assert sender.poll() == []
    assert [w.notification.transfer_id for w in net.writes] == ["a"] * 4
    assert sender.inflight_bytes == 128 and sender.queued_partitions == 4 + 8
