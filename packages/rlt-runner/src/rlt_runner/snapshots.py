"""`SnapshotStore`: CPU copies of preempted requests' device state (mechanism only, R04).

A snapshot holds, for one execution identity: the K/V of every page the request held, at every
plane (copied page by page into host memory, so no request-sized device temporary), its carried
hidden state, its pending sampled token and its sampling parameters. Restoring writes the pages
into the request's new blocks, page i of plane p into the new page i of plane p, so positions
keep their meaning while physical blocks change. The random stream needs no saving: it is a
function of (seed, output index), and the output index lives in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import ExecutionIdentity, SamplingParams

from rlt_runner.kv_storage import KVStorage
from rlt_runner.request_slots import RequestSlots


@dataclass
class DeviceSnapshot:
    keys: list[torch.Tensor]  # per plane: [L, pages, B, Hkv, D] on the host
    values: list[torch.Tensor]
    hidden: torch.Tensor  # [d]
    pending_token: torch.Tensor  # [] int64
    sampling: SamplingParams

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

    def save(self, identity: ExecutionIdentity, slots: RequestSlots, kv: KVStorage) -> None:
        """Copy the request's device state to the host and release its runner slot."""
        state = slots.state(identity)
        pin = kv.tensors.key_cache.is_cuda
        keys, values = [], []
        for table in state.host_tables:
            k, v = kv.read_blocks(table)
            keys.append(k.to("cpu", non_blocking=False).pin_memory() if pin else k.clone())
            values.append(v.to("cpu", non_blocking=False).pin_memory() if pin else v.clone())
        self._snapshots[identity] = DeviceSnapshot(
            keys=keys,
            values=values,
            hidden=slots.hidden[state.slot].to("cpu", copy=True),
            pending_token=slots.pending_token[state.slot].to("cpu", copy=True),
            sampling=state.sampling,
        )
        slots.release(identity)

    def sampling_of(self, identity: ExecutionIdentity) -> SamplingParams:
        return self._snapshots[identity].sampling

    def restore(self, identity: ExecutionIdentity, slots: RequestSlots, kv: KVStorage) -> None:
        """Write the saved state into the request's new slot and blocks. The slot must be
        assigned and its new block tables applied (covering at least the saved pages)."""
        snapshot = self._snapshots.pop(identity)
        state = slots.state(identity)
        for plane, table in enumerate(state.host_tables):
            pages = table[: snapshot.num_pages]
            if len(pages) < snapshot.num_pages:
                raise RuntimeError(
                    f"{identity}: restore needs {snapshot.num_pages} pages, has {len(pages)}"
                )
            kv.write_blocks(pages, snapshot.keys[plane], snapshot.values[plane])
        slots.hidden[state.slot] = snapshot.hidden.to(slots.hidden.device)
        slots.pending_token[state.slot] = snapshot.pending_token.to(slots.pending_token.device)

    def discard(self, identity: ExecutionIdentity) -> None:
        self._snapshots.pop(identity, None)
