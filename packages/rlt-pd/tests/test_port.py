"""TransportHandoffPort over the scripted fake transport: the engine-facing evidence
(sent / landed / failed / released) for a completed handoff, a cancel from either side, a
refused target, and a peer that is not connected; every transfer is released exactly once."""

from __future__ import annotations

import pytest
from fake_transport import FakeNetwork
from rlt_contracts.pd import HandoffEvents, HandoffTarget, PDRole
from rlt_pd import KVRegion, ReceiverConfig
from rlt_pd.port import TransportHandoffPort

REGION = KVRegion.contiguous(
    num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype_bytes=2
)
TARGET = HandoffTarget("t1", "D", ((4, 5),), 0, 1, 6)
SOURCE = ((0, 1),)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def setup():
    net, clock = FakeNetwork(), Clock()
    p, d = net.add("P", REGION), net.add("D", REGION)
    net.connect("P", "D")
    prefill = TransportHandoffPort(PDRole.PREFILL, p, clock=clock)
    decode = TransportHandoffPort(
        PDRole.DECODE, d, receiver_config=ReceiverConfig(lease_s=5.0), clock=clock
    )
    return net, clock, prefill, decode


def test_a_completed_handoff_is_sent_on_p_and_landed_on_d():
    net, _, prefill, decode = setup()
    decode.expect(TARGET, "P")
    prefill.send_chunk(TARGET, SOURCE, 0, 4, None)
    prefill.send_chunk(TARGET, SOURCE, 4, 6, 0)
    assert prefill.poll() == HandoffEvents()  # posted, nothing finished
    assert decode.poll() == HandoffEvents() and decode.busy
    net.complete_all("P")
    assert prefill.poll() == HandoffEvents(sent=("t1",))
    assert decode.poll() == HandoffEvents(landed=("t1",))
    assert not prefill.busy and not decode.busy


def test_a_cancel_on_d_fails_and_releases_both_sides_after_p_drained():
    net, _, prefill, decode = setup()
    decode.expect(TARGET, "P")
    prefill.send_chunk(TARGET, SOURCE, 0, 4, None)
    decode.cancel("t1")
    prefill.poll()  # gets the cancel; a write is still in flight
    net.complete_all("P")
    events = prefill.poll()
    assert events.sent == () and [t for t, _ in events.failed] == ["t1"]
    assert events.released == ("t1",)
    assert decode.poll() == HandoffEvents(released=("t1",))  # P's drained arrived


def test_a_cancel_on_p_fails_d_and_releases_both():
    net, _, prefill, decode = setup()
    decode.expect(TARGET, "P")
    prefill.send_chunk(TARGET, SOURCE, 0, 4, None)
    prefill.cancel("t1")
    net.complete_all("P")
    assert prefill.poll().released == ("t1",)
    events = decode.poll()
    assert [t for t, _ in events.failed] == ["t1"] and "aborted" in events.failed[0][1]
    assert events.released == ("t1",)


def test_a_dead_p_is_released_on_d_after_the_lease():
    _, clock, _, decode = setup()
    decode.expect(TARGET, "P")
    decode.cancel("t1")
    assert decode.poll() == HandoffEvents()
    clock.now = 5.5
    assert decode.poll().released == ("t1",)


def test_refusals_come_back_as_failed_and_released_not_exceptions():
    net, _, prefill, decode = setup()
    decode.expect(HandoffTarget("t2", "D", ((4,),), 0, 1, 3), "nobody")
    events = decode.poll()
    assert [t for t, _ in events.failed] == ["t2"] and "not connected" in events.failed[0][1]
    assert events.released == ("t2",)
    # a target whose pages do not fit: refused at start
    prefill.send_chunk(HandoffTarget("t3", "D", ((99, 98),), 0, 1, 6), SOURCE, 0, 4, None)
    events = prefill.poll()
    assert [t for t, _ in events.failed] == ["t3"] and events.released == ("t3",)
    # a chunk that does not continue the previous one: the started transfer is stopped once
    prefill.send_chunk(TARGET, SOURCE, 0, 4, None)
    prefill.send_chunk(TARGET, SOURCE, 5, 6, 0)
    assert prefill.poll() == HandoffEvents()  # the first chunk's write is still in flight
    net.complete_all("P")
    events = prefill.poll()
    assert len(events.failed) == 1 and "sending KV failed" in events.failed[0][1]
    assert events.released == ("t1",)


def test_the_role_decides_which_calls_exist():
    _, _, prefill, decode = setup()
    with pytest.raises(Exception, match="not a prefill"):
        prefill.expect(TARGET, "D")
    with pytest.raises(Exception, match="not a decode"):
        decode.send_chunk(TARGET, SOURCE, 0, 4, None)
    with pytest.raises(ValueError):
        TransportHandoffPort(PDRole.NONE, None)
