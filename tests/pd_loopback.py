"""A KV handoff port pair for two engines in one process: P's sends are byte copies between the
memory each runner declares (`rlt_contracts.PDMemory`), at the addresses its layout gives.

Both engines are built with the pair's port factory (`LLM(..., pd_role=ROLE,
handoff_port=pair.port)`). It implements `rlt_contracts.KVHandoffPort` with the same evidence
rules as the NIXL port (writes of a chunk land before its notification; the commit comes with
the final hidden state; cancel -> drained -> released), so the engines' PD logic is tested
without a transport, and the runners' declarations with it: the copies are exact token ranges
of every plane and layer (one range per page), nothing else in D's memory is touched, and a
range outside a declared allocation fails. CPU memory only.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from rlt_contracts import HandoffEvents, HandoffTarget, MemoryRegion, PDMemory, PDRole


@dataclass
class _Side:
    sent: list[str] = field(default_factory=list)
    landed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def take(self) -> HandoffEvents:
        events = HandoffEvents(
            tuple(self.sent), tuple(self.landed), tuple(self.failed), tuple(self.released)
        )
        self.sent, self.landed, self.failed, self.released = [], [], [], []
        return events


def copy_bytes(
    target: MemoryRegion, target_offset: int, source: MemoryRegion, source_offset: int, size: int
) -> None:
    for region, offset in ((target, target_offset), (source, source_offset)):
        assert region.device == "cpu" and 0 <= offset and offset + size <= region.size_bytes
    ctypes.memmove(target.address + target_offset, source.address + source_offset, size)


class LoopbackPair:
    """`port` is the handoff port factory of both engines; `written` counts copied positions
    per transfer."""

    def __init__(self) -> None:
        self.memory: dict[PDRole, PDMemory] = {}
        self._p, self._d = _Side(), _Side()
        self.expected: dict[str, HandoffTarget] = {}
        self.cancelled: set[str] = set()
        self.written: dict[str, int] = {}

    def port(self, role: PDRole, memory: PDMemory) -> _Port:
        self.memory[role] = memory
        return _Port(self, self._p if role is PDRole.PREFILL else self._d)

    def write(self, target, source_tables, start, end, final_hidden_row) -> None:
        tid = target.transfer_id
        if tid in self.cancelled or tid not in self.expected:
            self._p.failed.append((tid, "the decode side does not expect this transfer"))
            self._p.released.append(tid)
            return
        source, dest = self.memory[PDRole.PREFILL], self.memory[PDRole.DECODE]
        src, dst, block = source.kv, dest.kv, source.kv.block_size
        assert len(source_tables) == src.num_planes == dst.num_planes
        for src_table, dst_table in zip(source_tables, target.block_tables, strict=True):
            for page in range(start // block, -(-end // block)):  # one range per page
                low, high = max(start, page * block), min(end, (page + 1) * block)
                offset, count = low - page * block, high - low
                for layer in range(src.num_layers):
                    for s, d in ((src.key, dst.key), (src.value, dst.value)):
                        copy_bytes(
                            d,
                            dst.offset_bytes(layer, dst_table[page], offset),
                            s,
                            src.offset_bytes(layer, src_table[page], offset),
                            count * src.token_bytes,
                        )
        self.written[tid] = self.written.get(tid, 0) + (end - start)
        if final_hidden_row is not None:
            hidden, landing = source.hidden, dest.hidden
            copy_bytes(
                landing.region,
                landing.row_address(target.hidden_row) - landing.region.address,
                hidden.region,
                hidden.row_address(final_hidden_row) - hidden.region.address,
                hidden.row_bytes,
            )
            self._p.sent.append(tid)
            self._d.landed.append(tid)

    def cancel(self, transfer_id: str, side: _Side) -> None:
        """The cancelling side's peer learns it as a failure; both sides then drain (nothing is
        in flight in a loopback copy) and release."""
        self.cancelled.add(transfer_id)
        peer = self._d if side is self._p else self._p
        peer.failed.append((transfer_id, "cancelled by the other instance"))
        self._p.released.append(transfer_id)
        self._d.released.append(transfer_id)


class _Port:
    def __init__(self, pair: LoopbackPair, side: _Side) -> None:
        self.pair, self.side = pair, side

    def send_chunk(self, target, source_tables, start, end, final_hidden_row) -> None:
        self.pair.write(target, source_tables, start, end, final_hidden_row)

    def expect(self, target: HandoffTarget, prefill_agent: str) -> None:
        self.pair.expected[target.transfer_id] = target

    def cancel(self, transfer_id: str) -> None:
        self.pair.cancel(transfer_id, self.side)

    def poll(self) -> HandoffEvents:
        return self.side.take()

    def close(self) -> None:
        pass  # nothing registered
