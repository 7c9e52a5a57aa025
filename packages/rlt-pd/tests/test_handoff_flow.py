"""KVSender and KVReceiver together over the fake network: every valid byte lands exactly once
and nothing else changes, D activates only after everything landed, under random chunking,
cached prefixes, in-flight bounds and delivery orders; and the README's worked example."""

from __future__ import annotations

import random

import pytest
from fake_transport import FakeNetwork, decoded
from rlt_contracts.pd import HandoffTarget
from rlt_pd import (
    Commit,
    KVReceiver,
    KVRegion,
    KVSender,
    KVTensor,
    Landed,
    ReceiveEvent,
    ReceiveOutcome,
    SenderConfig,
    SendEvent,
    SendOutcome,
)


def region(num_blocks, allocated=None):
    return KVRegion.contiguous(
        num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=2,
        dtype_bytes=2, allocated_blocks=allocated,
    )  # fmt: skip


def expected_memory(p, d_initial, src_tables, dst_tables, first, prompt):
    """D's memory after the handoff, computed per token from the regions."""
    expected = {t: bytearray(m) for t, m in d_initial.items()}
    r, dr = p.region, p.network.endpoints["D"].region
    tb = r.token_bytes
    for t in KVTensor:
        for src, dst in zip(src_tables, dst_tables, strict=True):
            for pos in range(first, prompt):
                page, offset = divmod(pos, r.block_size)
                for layer in range(r.num_layers):
                    so = r.offset_bytes(t, layer, src[page], offset)
                    do = dr.offset_bytes(t, layer, dst[page], offset)
                    expected[t][do : do + tb] = p.memory[t][so : so + tb]
    return expected


@pytest.mark.parametrize("seed", range(40))
def test_random_handoffs_land_exactly_and_activate_only_when_complete(seed):
    rng = random.Random(seed)
    net = FakeNetwork()
    p = net.add("P", region(24, 25))
    d = net.add("D", region(40))
    net.connect("P", "D")
    p.fill_random(rng)
    d.fill_random(rng)
    d_initial = {t: bytes(m) for t, m in d.memory.items()}
    hidden_initial = bytes(d.hidden)
    config = SenderConfig(
        max_inflight_bytes=rng.choice([64, 200, 1 << 20]),
        transfer_chunk_bytes=rng.choice([48, 64]),
        max_descriptors=rng.choice([1, 3, 256]),
    )
    sender, receiver = KVSender(p, config), KVReceiver(d)
    planes, prompt = rng.choice([1, 4]), rng.randrange(1, 23)
    first = rng.randrange(0, prompt)  # the last prompt token is always computed on P
    pages = -(-prompt // 4)
    src = [rng.sample(range(24), pages) for _ in range(planes)]
    dst_blocks = rng.sample(range(40), planes * pages)
    dst = tuple(tuple(dst_blocks[i * pages : (i + 1) * pages]) for i in range(planes))
    target = HandoffTarget("t", "D", dst, first, 3, prompt)
    receiver.expect(target, "P")
    assert sender.start(target)
    cuts = sorted(rng.sample(range(1, prompt), rng.randrange(0, min(4, prompt)))) + [prompt]
    start, sent_events, received = 0, [], []
    for end in cuts:
        sender.send_chunk("t", src, start, end, final_hidden_row=1 if end == prompt else None)
        start = end
        # deliver a random subset of what is pending, landing and finishing independently
        for w in net.pending("P"):
            if not w.landed and rng.random() < 0.5:
                net.land(w.handle)
            if w.landed and rng.random() < 0.5:
                net.finish(w.handle)
        sent_events += sender.poll()
        received += receiver.poll()
    while not received:
        pending = net.pending("P")
        assert pending or any(not w.landed for w in net.writes), "stuck"
        w = rng.choice(pending) if pending else next(w for w in net.writes if not w.landed)
        if not w.landed:
            net.land(w.handle)
        elif rng.random() < 0.7:
            net.finish(w.handle)
        sent_events += sender.poll()
        assert sender.inflight_bytes <= config.max_inflight_bytes
        received += receiver.poll()
        if received:
            assert all(w.landed for w in net.writes), "activated before every write landed"
    assert received == [ReceiveEvent("t", ReceiveOutcome.COMPLETED)]
    for w in net.pending("P"):
        net.finish(w.handle)
    sent_events += sender.poll()
    assert sent_events == [SendEvent("t", SendOutcome.DONE)]
    assert d.memory == expected_memory(p, d_initial, src, dst, first, prompt)
    hb = d.hidden_state_bytes
    assert d.hidden[3 * hb : 4 * hb] == p.hidden[hb : 2 * hb]
    assert d.hidden[: 3 * hb] == hidden_initial[: 3 * hb]
    assert [w.notification.sequence for w in net.writes] == list(range(len(net.writes)))
    assert p.sent_messages() == [Commit("t", len(net.writes))]


def test_readme_worked_example():
    """40-token prompt, chunks of 16, B = 16, 2 planes, 2 layers, Hkv = 1, D = 4, fp16."""
    geometry = dict(num_layers=2, block_size=16, num_kv_heads=1, head_dim=4, dtype_bytes=2)
    net = FakeNetwork()
    p = net.add("P", KVRegion.contiguous(num_blocks=8, allocated_blocks=9, **geometry))
    d = net.add("D", KVRegion.contiguous(num_blocks=8, allocated_blocks=9, **geometry))
    p.hidden_state_bytes = d.hidden_state_bytes = 16
    net.connect("P", "D")
    sender, receiver = KVSender(p), KVReceiver(d)
    target = HandoffTarget("t1", "D", ((0, 1, 2), (3, 4, 5)), 0, 2, 40)
    receiver.expect(target, "P")
    sender.start(target)
    src = [[7, 6, 5], [2, 1, 0]]
    table = []
    for start, end in ((0, 16), (16, 32), (32, 40)):
        sender.send_chunk("t1", src, start, end, final_hidden_row=3 if end == 40 else None)
        for w in net.pending():
            table.append(
                (
                    w.notification.sequence,
                    [
                        (d_.tensor.value[0].upper(), d_.layer, d_.source_offset_bytes,
                         d_.destination_offset_bytes, d_.length_bytes)
                        for d_ in w.partition.descriptors
                    ],
                    w.partition.hidden_state_bytes,
                    w.hidden_rows,
                )
            )  # fmt: skip
            net.complete(w.handle)
    # block of one layer = 16 tokens x 8 bytes = 128; layer stride = 9 blocks = 1152
    assert table == [
        (0, [(t, i, 1152 * i + s * 128, 1152 * i + o * 128, 128) for t in "KV" for i in (0, 1)
             for s, o in ((7, 0), (2, 3))], 0, None),
        (1, [(t, i, 1152 * i + s * 128, 1152 * i + o * 128, 128) for t in "KV" for i in (0, 1)
             for s, o in ((6, 1), (1, 4))], 0, None),
        (2, [(t, i, 1152 * i + s * 128, 1152 * i + o * 128, 64) for t in "KV" for i in (0, 1)
             for s, o in ((5, 2), (0, 5))], 16, (3, 2)),
    ]  # fmt: skip
    assert p.sent_messages() == [Commit("t1", 3)]
    # the commit follows the *posting* of partition 2, so it may arrive before 2 landed
    assert decoded(d.inbox) == [Landed("t1", 0), Landed("t1", 1), Commit("t1", 3), Landed("t1", 2)]
    assert receiver.poll() == [ReceiveEvent("t1", ReceiveOutcome.COMPLETED)]
    assert sender.poll() == [SendEvent("t1", SendOutcome.DONE)]


def test_sender_done_is_not_delivery():
    """P may free its blocks once its writes finished locally; D still waits for the bytes."""
    net = FakeNetwork()
    p = net.add("P", region(8))
    d = net.add("D", region(8))
    net.connect("P", "D")
    sender, receiver = KVSender(p), KVReceiver(d)
    target = HandoffTarget("t", "D", ((4, 5),), 0, 0, 6)
    receiver.expect(target, "P")
    sender.start(target)
    sender.send_chunk("t", [[0, 1]], 0, 6, final_hidden_row=0)
    for w in net.pending():
        net.finish(w.handle)  # DONE locally, nothing landed yet
    assert sender.poll() == [SendEvent("t", SendOutcome.DONE)]
    assert receiver.poll() == []  # the commit arrived, the notification did not
    assert receiver.tracker("t").commit_count == 1
    for w in net.writes:
        net.land(w.handle)
    assert receiver.poll() == [ReceiveEvent("t", ReceiveOutcome.COMPLETED)]
