"""`SnapshotStore`: host copies of preempted requests' device state (mechanism only, R04).

A snapshot holds, for one execution identity: the K/V of every page the request held, at every
plane, its row's progress (hidden state, looping token, position, loop count, exit state,
outputs, active/parked/held flags), the part of its row's logits state that activation does not
rewrite (`LogitsState.save_row`) and its host record (sampling parameters, decode rule,
prompt). README.md, "Snapshots and memory", says how a restore maps pages to the new blocks,
what is rewritten from the record, why no RNG state is saved and why queued, non-blocking
copies are complete before a restore reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import ExecutionIdentity

from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_record import RowRecord
from rlt_runner.row_state import PROGRESS_BUFFERS, DecodeRows
from rlt_runner.transfers import download, upload


@dataclass
class DeviceSnapshot:
    record: RowRecord
    keys: list[torch.Tensor]  # per plane: [L, pages, B, Hkv, D] in host memory
    values: list[torch.Tensor]
    progress: dict[str, torch.Tensor]  # PROGRESS_BUFFERS name -> [1, ...] in host memory
    logits: dict[str, torch.Tensor]  # LogitsState.save_row: its buffers' [1, ...] host copies

    @property
    def num_pages(self) -> int:
        return int(self.keys[0].shape[1])


class SnapshotStore:
    def __init__(self) -> None:
        self._snapshots: dict[ExecutionIdentity, DeviceSnapshot] = {}

    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, identity: ExecutionIdentity) -> bool:
        return identity in self._snapshots

    def identities(self) -> list[ExecutionIdentity]:
        return list(self._snapshots)

    def save(self, identity: ExecutionIdentity, rows: DecodeRows, kv: KVStorage) -> None:
        """Copy the request's device state to the host and release its row."""
        record = rows.record(identity)
        keys, values = [], []
        for table in record.host_tables:
            k, v = kv.read_blocks(upload(table, torch.int64, kv.device))
            keys.append(download(k))
            values.append(download(v))
        progress = {
            name: download(getattr(rows, name)[record.row : record.row + 1])
            for name in PROGRESS_BUFFERS
        }
        logits = rows.logits_state.save_row(record)
        self._snapshots[identity] = DeviceSnapshot(record, keys, values, progress, logits)
        rows.release([identity])

    def record_of(self, identity: ExecutionIdentity) -> RowRecord:
        snapshot = self._snapshots.get(identity)
        if snapshot is None:
            raise RuntimeError(f"no preemption snapshot of {identity} to restore")
        return snapshot.record

    def restore(self, identity: ExecutionIdentity, rows: DecodeRows, kv: KVStorage) -> None:
        """Write the saved state into the request's new row and blocks. The row must be
        assigned and its new block tables applied (covering at least the saved pages)."""
        snapshot = self._snapshots.pop(identity)
        record = rows.record(identity)
        for plane, table in enumerate(record.host_tables):
            pages = table[: snapshot.num_pages]
            if len(pages) < snapshot.num_pages:
                raise RuntimeError(
                    f"{identity}: restore needs {snapshot.num_pages} pages, has {len(pages)}"
                )
            kv.write_blocks(
                upload(pages, torch.int64, kv.device), snapshot.keys[plane], snapshot.values[plane]
            )
        for name, saved in snapshot.progress.items():
            getattr(rows, name)[record.row : record.row + 1].copy_(saved, non_blocking=True)
        rows.logits_state.restore_row(record.row, snapshot.logits)

    def discard(self, identity: ExecutionIdentity) -> None:
        self._snapshots.pop(identity, None)
