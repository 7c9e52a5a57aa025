"""A KV handoff port pair for two engines in one process: P's sends are byte copies between the
memory each runner declares (`rlt_contracts.PDMemory`), at the addresses its layout gives.

Both engines are built with the pair's port factory (`LLM(..., pd_role=ROLE,
handoff_port=pair.port)`). It implements `rlt_contracts.KVHandoffPort` with the same evidence
rules as the NIXL port (writes of a chunk land before its notification; the commit comes with
the final hidden state; cancel -> drained -> released), so the engines' PD logic is tested
without a transport, and the runners' declarations with it: the copies are exact token ranges
of every plane and layer (one range per page), nothing else in D's memory is touched, and a
range outside a declared allocation fails. CPU or CUDA memory (viewed as bytes by address).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
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


def byte_view(region: MemoryRegion) -> torch.Tensor:
    """The region's bytes as a uint8 tensor over its memory, from its address alone."""
    if region.device == "cpu":
        buffer = (ctypes.c_uint8 * region.size_bytes).from_address(region.address)
        return torch.frombuffer(buffer, dtype=torch.uint8)
    interface = dict(shape=(region.size_bytes,), typestr="|u1", data=(region.address, False))
    memory = type("Bytes", (), {"__cuda_array_interface__": {**interface, "version": 3}})()
    return torch.as_tensor(memory, device=torch.device("cuda", region.device_index))


def copy_bytes(target: torch.Tensor, at: int, source: torch.Tensor, start: int, size: int) -> None:
    assert at + size <= target.numel() and start + size <= source.numel()
    target[at : at + size].copy_(source[start : start + size])


class LoopbackPair:
    """`port` is the handoff port factory of both engines; `written` counts copied positions
    per transfer."""

    def __init__(self) -> None:
        self.memory: dict[PDRole, PDMemory] = {}
        self.bytes: dict[PDRole, tuple[torch.Tensor, ...]] = {}  # K, V, hidden rows
        self._p, self._d = _Side(), _Side()
        self.expected: dict[str, HandoffTarget] = {}
        self.cancelled: set[str] = set()
        self.written: dict[str, int] = {}

    def port(self, role: PDRole, memory: PDMemory) -> _Port:
        self.memory[role] = memory
        regions = (memory.kv.key, memory.kv.value, memory.hidden.region)
        self.bytes[role] = tuple(byte_view(region) for region in regions)
        return _Port(self, self._p if role is PDRole.PREFILL else self._d)

    def write(self, target, source_tables, start, end, final_hidden_row) -> None:
        tid = target.transfer_id
        if tid in self.cancelled or tid not in self.expected:
            self._p.failed.append((tid, "the decode side does not expect this transfer"))
            self._p.released.append(tid)
            return
        source, dest = self.memory[PDRole.PREFILL], self.memory[PDRole.DECODE]
        src, dst, block = source.kv, dest.kv, source.kv.block_size
        src_k, src_v, src_h = self.bytes[PDRole.PREFILL]
        dst_k, dst_v, dst_h = self.bytes[PDRole.DECODE]
        assert len(source_tables) == src.num_planes == dst.num_planes
        for src_table, dst_table in zip(source_tables, target.block_tables, strict=True):
            for page in range(start // block, -(-end // block)):  # one range per page
                low, high = max(start, page * block), min(end, (page + 1) * block)
                offset, count = low - page * block, high - low
                for layer in range(src.num_layers):
                    for s, d in ((src_k, dst_k), (src_v, dst_v)):
                        copy_bytes(
                            d,
                            dst.offset_bytes(layer, dst_table[page], offset),
                            s,
                            src.offset_bytes(layer, src_table[page], offset),
                            count * src.token_bytes,
                        )
        self.written[tid] = self.written.get(tid, 0) + (end - start)
        if final_hidden_row is not None:
            row_bytes = source.hidden.row_bytes
            at, row_start = target.hidden_row * row_bytes, final_hidden_row * row_bytes
            copy_bytes(dst_h, at, src_h, row_start, row_bytes)
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
