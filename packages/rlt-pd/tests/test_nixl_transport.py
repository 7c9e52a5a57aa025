"""KVTransport over the real `nixl` package (UCX backend) on CPU tensors' memory.

Local checks in this process; the handshake and transfers between this process (P) and a
spawned one (D, tests/nixl_peer.py) over UCX: compatibility refusals naming the fields, WRITEs of
full and partial pages and the hidden row landing exactly (untouched bytes unchanged, bytes
there when the notification arrives), commit and notifications, the connectors end to end,
cancel -> drained -> release, a write to a disconnected peer failing without raising, close.
"""

from __future__ import annotations

import multiprocessing
import time

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

import nixl_peer  # noqa: E402
from nixl_peer import BLOCK, compatibility, tensors, transport  # noqa: E402
from rlt_contracts import ExecutionIdentity  # noqa: E402
from rlt_contracts.pd import HandoffTarget  # noqa: E402
from rlt_pd import (  # noqa: E402
    Cancel,
    Commit,
    Drained,
    KVSender,
    Landed,
    PDCompatibilityError,
    PDTransportError,
    SendOutcome,
    plan_handoff,
)


class Peer:
    """The D process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=nixl_peer.serve, args=(child,), daemon=True)
        self.process.start()

    def submit(self, command: str, **kwargs) -> None:
        self.conn.send((command, kwargs))

    def result(self, timeout: float = 60.0):
        assert self.conn.poll(timeout), "peer process did not answer"
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"peer raised {reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, command: str, **kwargs):
        self.submit(command, **kwargs)
        return self.result()

    def error(self, command: str, **kwargs) -> tuple[str, str]:
        self.submit(command, **kwargs)
        reply = self.conn.recv()
        assert reply[0] == "error", reply
        return reply[1], reply[2]

    def stop(self) -> None:
        try:
            self.call("exit")
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


@pytest.fixture(scope="module")
def link():
    """(P transport, P tensors, D peer process, D's initial tensors), connected both ways."""
    peer = Peer()  # starts importing torch and nixl while this process builds P
    p_tensors = tensors(seed=1)
    p = transport("P", p_tensors, compatibility())
    d_meta = peer.call("init", name="D", seed=2, compat={})
    assert p.connect(d_meta) == "D"
    assert peer.call("connect", metadata=p.metadata()) == "P"
    initial = peer.call("snapshot")
    yield p, p_tensors, peer, initial
    p.close()
    peer.stop()


def wait_poll(transport, handles, timeout=10.0):
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < len(handles) and time.monotonic() < deadline:
        polled = transport.poll()
        done += polled.completed
        failed += polled.failed
        time.sleep(0.0005)
    return done, failed


def expected_after(initial, source, src_tables, dst_tables, first, end, hidden=None):
    """D's K, V, hidden after positions [first, end) of every plane and the hidden row landed."""
    k, v, h = (t.clone() for t in initial)
    for dst, src in ((k, source[0]), (v, source[1])):
        for s_table, d_table in zip(src_tables, dst_tables, strict=True):
            for pos in range(first, end):
                page, offset = divmod(pos, BLOCK)
                dst[:, d_table[page], offset] = src[:, s_table[page], offset]
    if hidden is not None:
        h[hidden[1]] = source[2][hidden[0]]
    return k, v, h


def assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.view(torch.int16), e.view(torch.int16))  # bitwise


# -- local -------------------------------------------------------------------------------------


def test_compatibility_must_describe_the_memory():
    with pytest.raises(ValueError, match="block_size: 32 declared, 16 in the memory"):
        transport("x", tensors(seed=None), compatibility(block_size=32))
    with pytest.raises(ValueError, match="hidden_bytes: 4 declared, 16"):
        transport("x", tensors(seed=None), compatibility(hidden_bytes=4))


def test_close_deregisters_and_is_idempotent():
    closing = transport("closing", tensors(seed=None), compatibility())
    assert isinstance(closing.metadata(), bytes)
    closing.close()
    closing.close()
    assert closing.closed and closing.peers == ()
    with pytest.raises(PDTransportError, match="closed"):
        closing.metadata()
    with pytest.raises(PDTransportError, match="closed"):
        closing.send("D", Cancel("t"))


def test_prepared_indices_for_whole_blocks_and_explicit_for_partial_pages():
    """The README example's partitions: full pages by index, the partial last page explicit."""
    a = transport("A", tensors(seed=None), compatibility())
    b = transport("B", tensors(seed=None), compatibility())
    try:
        a.connect(b.metadata())
        ident = ExecutionIdentity("t", 0)
        src, dst = [[7, 6, 5], [2, 1, 0]], [[0, 1, 2], [3, 4, 5]]
        kwargs = dict(hidden_state_bytes=a.hidden_state_bytes)
        chunk0 = plan_handoff(ident, src, dst, 16, a.region, final=False, **kwargs)
        assert a.prepared_indices("B", chunk0.partitions[0]) == (
            [7, 2, 16, 11, 25, 20, 34, 29],
            [0, 3, 9, 12, 18, 21, 27, 30],
        )
        chunk1 = plan_handoff(ident, src, dst, 32, a.region, first_token=16, final=False, **kwargs)
        [partition] = chunk1.partitions
        local, remote = a.prepared_indices("B", partition)
        # index = tensor * L * A + layer * A + block with L = 2, A = 9 (K/V), then 36 + row
        assert local == [6, 1, 15, 10, 24, 19, 33, 28]
        assert remote == [1, 4, 10, 13, 19, 22, 28, 31]
        [last] = plan_handoff(ident, src, dst, 40, a.region, first_token=32, **kwargs).partitions
        assert a.prepared_indices("B", last, (3, 2)) is None
        only_hidden = plan_handoff(ident, [[]], [[]], 8, a.region, first_token=8, **kwargs)
        assert a.prepared_indices("B", only_hidden.partitions[0], (3, 2)) == ([39], [38])
    finally:
        a.close()
        b.close()


def test_nixl_exceptions_become_failed_writes():
    """NIXL raises (not ERR) for a peer removed under a prepared list: write() reports it."""
    a = transport("A2", tensors(seed=None), compatibility())
    b = transport("B2", tensors(seed=None), compatibility())
    try:
        a.connect(b.metadata())
        a._agent.remove_remote_agent("B2")  # behind the transport's back: stale lists
        ident = ExecutionIdentity("t", 0)
        kwargs = dict(hidden_state_bytes=a.hidden_state_bytes)
        [whole] = plan_handoff(ident, [[1]], [[2]], 16, a.region, final=False, **kwargs).partitions
        [partial] = plan_handoff(ident, [[1]], [[2]], 5, a.region, **kwargs).partitions
        handles = [
            a.write("B2", whole, Landed("t", 0)),
            a.write("B2", partial, Landed("t", 1), hidden_rows=(0, 0)),
        ]
        polled = a.poll()
        assert polled.completed == [] and [h for h, _ in polled.failed] == handles
        assert all("posting a write to 'B2' failed: nixl" in r for _, r in polled.failed)
        a.disconnect("B2")  # removing the already-removed agent is logged, not raised
        assert a.peers == ()
    finally:
        a.close()
        b.close()


# -- two processes -----------------------------------------------------------------------------


def test_handshake_refuses_a_mismatch_naming_every_field(link):
    p, _, peer, _ = link
    theirs = dict(block_size=8, model_identity="other-model", dtype="bfloat16")
    other = transport("P-bad", tensors(seed=None, block_size=8), compatibility(**theirs))
    try:
        with pytest.raises(PDCompatibilityError) as caught:
            other.connect(peer.call("metadata"))
        text = str(caught.value)
        for field in ("block_size: 8 here, 16 there", "model_identity", "dtype", "block_bytes"):
            assert field in text
        assert "num_layers" not in text and "D" not in other.peers
        kind, message = peer.error("connect", metadata=other.metadata())  # and on D's side
        assert kind == "PDCompatibilityError" and "block_size: 16 here, 8 there" in message
    finally:
        other.close()


def test_full_and_partial_pages_and_hidden_row_land_exactly(link):
    p, p_tensors, peer, _ = link
    before = peer.call("snapshot")
    hb = p.hidden_state_bytes
    # positions [5, 27) of 2 planes: page 0 from token 5, page 1 up to token 10 (token-exact)
    src, dst = [[0, 1], [2, 3]], [[4, 5], [6, 7]]
    [partial] = plan_handoff(
        ExecutionIdentity("partial", 0), src, dst, 27, p.region, first_token=5,
        hidden_state_bytes=hb,
    ).partitions  # fmt: skip
    [full] = plan_handoff(
        ExecutionIdentity("full", 0), [[7]], [[1]], 16, p.region, hidden_state_bytes=hb,
        final=False,
    ).partitions  # fmt: skip
    posted_before = p.posted
    handles = [
        p.write("D", partial, Landed("partial", 0), hidden_rows=(1, 3)),
        p.write("D", full, Landed("full", 0)),
    ]
    assert p.posted["explicit"] - posted_before["explicit"] == 1  # token-exact ranges
    assert p.posted["prepped"] - posted_before["prepped"] == 1  # a whole block, by index
    done, failed = wait_poll(p, handles)
    assert failed == [] and sorted(done) == sorted(handles)
    arrivals = {m.transfer_id: (name, m, snap) for name, m, snap in peer.call(
        "wait_notifications", count=2
    )}  # fmt: skip
    assert {k: v[:2] for k, v in arrivals.items()} == {
        "partial": ("P", Landed("partial", 0)),
        "full": ("P", Landed("full", 0)),
    }
    want_partial = expected_after(before, p_tensors, src, dst, 5, 27, hidden=(1, 3))
    want = expected_after(want_partial, p_tensors, [[7]], [[1]], 0, 16)
    assert_same(peer.call("snapshot"), want)  # every other byte of D is unchanged
    # a notification means its bytes landed: the snapshot taken on arrival already has them
    k, v, h = arrivals["partial"][2]
    assert_same((k[:, 4:8], v[:, 4:8], h[3]), (want[0][:, 4:8], want[1][:, 4:8], want[2][3]))
    k, v, _ = arrivals["full"][2]
    assert_same((k[:, 1], v[:, 1]), (p_tensors[0][:, 7], p_tensors[1][:, 7]))


def test_control_messages_arrive(link):
    p, _, peer, _ = link
    for message in (Commit("ctl", 3), Drained("ctl")):
        p.send("D", message)
    arrivals = peer.call("wait_notifications", count=2)
    assert [(name, m) for name, m, _ in arrivals] == [
        ("P", Commit("ctl", 3)),
        ("P", Drained("ctl")),
    ]
    with pytest.raises(PDTransportError, match="not connected"):
        p.send("nobody", Commit("ctl", 1))


def test_connectors_end_to_end_readme_example(link):
    """40 tokens, chunks of 16, B = 16, 2 planes: 3 partitions (2 by index, 1 explicit with the
    hidden state), commit(3); D completes only after everything landed."""
    p, p_tensors, peer, _ = link
    before = peer.call("snapshot")
    target = HandoffTarget("e2e", "D", ((0, 1, 2), (3, 4, 5)), 0, 2, 40)
    peer.call("expect", target=msgspec.msgpack.encode(target), prefill_agent="P")
    sender = KVSender(p)
    assert sender.start(target)
    peer.submit("poll_receiver", until=1)  # D polls in its process while P sends
    src = [[7, 6, 5], [2, 1, 0]]
    posted_before = p.posted
    sender.send_chunk("e2e", src, 0, 16)
    sender.send_chunk("e2e", src, 16, 32)
    sender.send_chunk("e2e", src, 32, 40, final_hidden_row=3)
    events, deadline = [], time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        events = sender.poll()
        time.sleep(0.0005)
    assert [(e.transfer_id, e.outcome) for e in events] == [("e2e", SendOutcome.DONE)]
    assert [tuple(e)[:2] for e in peer.result()] == [("e2e", "completed")]
    assert p.posted["prepped"] - posted_before["prepped"] == 2
    assert p.posted["explicit"] - posted_before["explicit"] == 1
    expected = expected_after(before, p_tensors, src, target.block_tables, 0, 40, hidden=(3, 2))
    assert_same(peer.call("snapshot"), expected)


def test_cancel_from_decode_drains_and_releases(link):
    p, _, peer, _ = link
    target = HandoffTarget("gone", "D", ((6,), (7,)), 0, 1, 16)
    peer.call("expect", target=msgspec.msgpack.encode(target), prefill_agent="P")
    sender = KVSender(p)
    sender.start(target)
    peer.submit("poll_receiver", until=1, cancel="gone")
    events, deadline = [], time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        events = sender.poll()
        time.sleep(0.0005)
    assert [(e.transfer_id, e.outcome) for e in events] == [("gone", SendOutcome.CANCELLED)]
    assert [tuple(e)[:2] for e in peer.result()] == [("gone", "released")]
    assert sender.send_chunk("gone", [[0], [1]], 0, 16, final_hidden_row=0) is False


def test_write_to_a_disconnected_peer_fails_then_reconnects(link):
    p, _, peer, _ = link
    ident = ExecutionIdentity("late", 0)
    [part] = plan_handoff(ident, [[0]], [[1]], 4, p.region, hidden_state_bytes=16).partitions
    p.disconnect("D")
    assert not p.is_connected("D")
    handle = p.write("D", part, Landed("late", 0), hidden_rows=(0, 0))
    assert p.poll().failed == [(handle, "peer 'D' is not connected")]
    assert p.connect(peer.call("metadata")) == "D"  # handshake again
    handle = p.write("D", part, Landed("late", 0), hidden_rows=(0, 0))
    done, failed = wait_poll(p, [handle])
    assert done == [handle] and failed == []
    assert [m for _, m, _ in peer.call("wait_notifications", count=1)] == [Landed("late", 0)]


def test_peer_close_is_idempotent(link):
    _, _, peer, _ = link
    peer.call("snapshot")
    # the module fixture closes P; D closes here (twice) and reports closed
    assert peer.call("close") is True
