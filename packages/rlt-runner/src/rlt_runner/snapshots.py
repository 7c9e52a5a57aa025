"""`SnapshotStore`: host copies of preempted requests' device state (mechanism only, R04).

A snapshot holds, for one execution identity: the K/V of every page the request held, at every
plane, its row's progress (hidden state, looping token, position, loop count, exit state,
outputs, active/parked/held flags), the part of its row's logits state that activation does not
rewrite (`LogitsState.save_row`: a penalized request's output counts, [V] int32; a structured
request's token bitmask) and its host record (sampling parameters, decode rule, prompt). Row
activation on restore rewrites the rest of the logits state from the record (prompt mask,
logit_bias, stop mask). Restoring writes the pages into the request's new blocks (page i of
plane p into the new page i of plane p, so positions keep their meaning while physical blocks
change) and the progress into its new row. The random stream needs no saving: it is a function
of (seed, output index).

On CUDA every copy is queued without blocking: the device-to-host copies land in pinned memory
in stream order, and a restore's host-to-device copies are queued after them, so a snapshot is
complete before any restore can read it.
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
