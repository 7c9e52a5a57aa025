"""A KV handoff port pair for two engines in one process: P's sends are tensor copies into D.

It implements `rlt_contracts.KVHandoffPort` with the same evidence rules as the NIXL port
(writes of a chunk land before its notification; the commit comes with the final hidden state;
cancel -> drained -> released), so the engines' PD logic is tested without a transport. The
copies are exact: token ranges of every plane and layer, nothing else in D's pool is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rlt_contracts import HandoffEvents, HandoffTarget
from rlt_runner import ModelRunner


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


class LoopbackPair:
    """`prefill_port` for P's engine, `decode_port` for D's; `written` counts copied positions."""

    def __init__(self, prefill: ModelRunner, decode: ModelRunner) -> None:
        self.prefill_runner, self.decode_runner = prefill, decode
        self._p, self._d = _Side(), _Side()
        self.expected: dict[str, HandoffTarget] = {}
        self.cancelled: set[str] = set()
        self.written: dict[str, int] = {}
        self.prefill_port = _Port(self, self._p)
        self.decode_port = _Port(self, self._d)

    def write(self, target, source_tables, start, end, final_hidden_row) -> None:
        tid = target.transfer_id
        if tid in self.cancelled or tid not in self.expected:
            self._p.failed.append((tid, "the decode side does not expect this transfer"))
            self._p.released.append(tid)
            return
        source, dest = self.prefill_runner, self.decode_runner
        block = source.block_size
        for plane, (src_table, dst_table) in enumerate(
            zip(source_tables, target.block_tables, strict=True)
        ):
            for position in range(start, end):
                page, offset = divmod(position, block)
                for name in ("key_cache", "value_cache"):
                    src = getattr(source.kv.tensors, name)
                    dst = getattr(dest.kv.tensors, name)
                    dst[:, dst_table[page], offset] = src[:, src_table[page], offset]
            del plane
        self.written[tid] = self.written.get(tid, 0) + (end - start)
        if final_hidden_row is not None:
            dest.rows.landing[target.hidden_row] = source.rows.hidden[final_hidden_row]
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
        with torch.inference_mode():
            self.pair.write(target, source_tables, start, end, final_hidden_row)

    def expect(self, target: HandoffTarget, prefill_agent: str) -> None:
        self.pair.expected[target.transfer_id] = target

    def cancel(self, transfer_id: str) -> None:
        self.pair.cancel(transfer_id, self.side)

    def poll(self) -> HandoffEvents:
        return self.side.take()

    def close(self) -> None:
        pass  # nothing registered
