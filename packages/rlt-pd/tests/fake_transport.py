"""A scripted in-memory `Transport` for the connector tests: memory as bytearrays, writes that
land, finish or fail only when the test says so, and notifications in an inbox per endpoint.

`FakeNetwork` links endpoints by name. A write posted by `a` to `b` stays pending until the test
calls `land(handle)` (copy the bytes into b's memory and queue the notification at b),
`finish(handle)` (a's poll reports it completed) or `fail(handle)`; `complete` does both of the
first two. Control messages go straight into the peer's inbox (or are refused while
`refuse_sends` is set). Every message is encoded and decoded with the real codec.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from rlt_pd import (
    ControlMessage,
    KVRegion,
    KVTensor,
    PDTransportError,
    TransferPartition,
    TransportPoll,
    decode_message,
    encode_message,
)


@dataclass
class Write:
    handle: int
    source: str
    peer: str
    partition: TransferPartition
    notification: ControlMessage
    hidden_rows: tuple[int, int] | None
    landed: bool = False
    finished: bool = False


@dataclass
class FakeTransport:
    network: FakeNetwork
    name: str
    region: KVRegion
    hidden_state_bytes: int = 8
    hidden_rows: int = 4
    memory: dict[KVTensor, bytearray] = field(default_factory=dict)
    hidden: bytearray = field(default_factory=bytearray)
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    sent: list[tuple[str, ControlMessage]] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    connected: set[str] = field(default_factory=set)
    refuse_sends: bool = False

    def __post_init__(self) -> None:
        alloc = self.region.key_layer_stride_bytes * self.region.num_layers
        for tensor in KVTensor:
            self.memory[tensor] = bytearray(alloc)
        self.hidden = bytearray(self.hidden_rows * self.hidden_state_bytes)

    def fill_random(self, rng: random.Random) -> None:
        for tensor in KVTensor:
            self.memory[tensor][:] = rng.randbytes(len(self.memory[tensor]))
        self.hidden[:] = rng.randbytes(len(self.hidden))

    # -- Transport -----------------------------------------------------------------------------

    def peer_region(self, peer: str) -> KVRegion:
        if peer not in self.connected:
            raise PDTransportError(f"{peer!r} not connected")
        return self.network.endpoints[peer].region

    def is_connected(self, peer: str) -> bool:
        return peer in self.connected

    def write(self, peer, partition, notification, *, hidden_rows=None) -> int:
        assert bool(partition.hidden_state_bytes) == (hidden_rows is not None)
        assert partition.num_writes > 0
        handle = next(self.network.handles)
        write = Write(handle, self.name, peer, partition, notification, hidden_rows)
        self.network.writes.append(write)
        if peer not in self.connected:
            self.failed.append((handle, f"peer {peer!r} is not connected"))
            write.finished = True
        return handle

    def send(self, peer: str, message: ControlMessage) -> None:
        if self.refuse_sends or peer not in self.connected:
            raise PDTransportError(f"cannot send to {peer!r}")
        self.sent.append((peer, message))
        self.network.endpoints[peer].inbox.append((self.name, encode_message(message)))

    def poll(self) -> TransportPoll:
        completed, failed = self.completed, self.failed
        self.completed, self.failed = [], []
        return TransportPoll(completed, failed)

    def notifications(self) -> list[tuple[str, bytes]]:
        inbox, self.inbox = self.inbox, []
        return inbox

    # -- test helpers --------------------------------------------------------------------------

    def sent_messages(self) -> list[ControlMessage]:
        return [m for _, m in self.sent]


class FakeNetwork:
    def __init__(self) -> None:
        self.endpoints: dict[str, FakeTransport] = {}
        self.writes: list[Write] = []
        self.handles = itertools.count(100)

    def add(self, name: str, region: KVRegion, **kwargs) -> FakeTransport:
        endpoint = FakeTransport(self, name, region, **kwargs)
        self.endpoints[name] = endpoint
        return endpoint

    def connect(self, a: str, b: str) -> None:
        self.endpoints[a].connected.add(b)
        self.endpoints[b].connected.add(a)

    def write(self, handle: int) -> Write:
        return next(w for w in self.writes if w.handle == handle)

    def pending(self, source: str | None = None) -> list[Write]:
        """Writes not finished locally yet (in posting order)."""
        return [w for w in self.writes if not w.finished and source in (None, w.source)]

    def land(self, handle: int) -> None:
        """The bytes arrive at the target, then its notification."""
        w = self.write(handle)
        assert not w.landed
        w.landed = True
        src, dst = self.endpoints[w.source], self.endpoints[w.peer]
        for d in w.partition.descriptors:
            s, o, n = d.source_offset_bytes, d.destination_offset_bytes, d.length_bytes
            dst.memory[d.tensor][o : o + n] = src.memory[d.tensor][s : s + n]
        if w.hidden_rows is not None:
            hb = src.hidden_state_bytes
            s, o = w.hidden_rows[0] * hb, w.hidden_rows[1] * hb
            dst.hidden[o : o + hb] = src.hidden[s : s + hb]
        dst.inbox.append((w.source, encode_message(w.notification)))

    def finish(self, handle: int) -> None:
        """The initiator's poll reports the write DONE."""
        w = self.write(handle)
        assert not w.finished
        w.finished = True
        self.endpoints[w.source].completed.append(handle)

    def complete(self, handle: int) -> None:
        self.land(handle)
        self.finish(handle)

    def fail(self, handle: int, reason: str = "ERR") -> None:
        w = self.write(handle)
        assert not w.finished
        w.finished = True
        self.endpoints[w.source].failed.append((handle, reason))

    def complete_all(self, source: str | None = None) -> int:
        pending = self.pending(source)
        for w in pending:
            self.complete(w.handle)
        return len(pending)


def decoded(inbox: list[tuple[str, bytes]]) -> list[ControlMessage]:
    return [decode_message(raw) for _, raw in inbox]
