"""NIXL descriptors of a transfer partition: which bytes of one side's registered memory a
write reads and which bytes of the other side's it fills. Pure functions over `MemoryExtent`s
(addresses and geometry, no agent), so `KVTransport` only posts what they describe.

Prepared list of a side (built once per side, `prepared_table`): one row per (tensor, layer,
block) for K and V, then one per hidden row, as (address, length, device):

    index = tensor * L * A + layer * A + block      (tensor 0 = K, 1 = V)
    index = 2 * L * A + row                         (the rows' hidden states)

A partition made of whole blocks on both sides maps to index lists (`prepared_indices`); one
with any token-exact range (a partial page) needs explicit (address, length, device) rows
(`explicit_descriptors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rlt_contracts.pd import PDCompatibility
from rlt_contracts.pd_memory import PDMemory

from rlt_pd.handoff import TransferPartition
from rlt_pd.messages import TransportMetadata
from rlt_pd.region import KVTensor


@dataclass(frozen=True)
class MemoryExtent:
    """One side's registered memory: K and V [L, A, B, Hkv, D] and hidden rows [S, d].

    layer_blocks: L * A, the (layer, block) pairs of one K or V tensor.
    block_bytes: bytes of one block of one layer of one tensor (B * Hkv * D * element).
    """

    key_address: int
    value_address: int
    hidden_address: int
    layer_blocks: int
    block_bytes: int
    hidden_rows: int
    hidden_row_bytes: int
    device_id: int

    @property
    def tensor_bytes(self) -> int:
        """Extent of each of the K and V tensors."""
        return self.layer_blocks * self.block_bytes

    @classmethod
    def of_memory(cls, memory: PDMemory) -> MemoryExtent:
        kv = memory.kv
        return cls(
            key_address=kv.key.address,
            value_address=kv.value.address,
            hidden_address=memory.hidden.region.address,
            layer_blocks=kv.num_layers * kv.allocated_blocks,
            block_bytes=kv.block_bytes,
            hidden_rows=memory.hidden.num_rows,
            hidden_row_bytes=memory.hidden.row_bytes,
            device_id=kv.key.device_index,
        )

    @classmethod
    def of_peer(cls, meta: TransportMetadata) -> MemoryExtent:
        return cls(
            key_address=meta.key_address,
            value_address=meta.value_address,
            hidden_address=meta.hidden_address,
            layer_blocks=meta.region.num_layers * meta.allocated_blocks,
            block_bytes=meta.region.block_bytes,
            hidden_rows=meta.hidden_rows,
            hidden_row_bytes=meta.hidden_row_stride_bytes,
            device_id=meta.device_id,
        )


def check_memory(memory: PDMemory, compat: PDCompatibility) -> None:
    """ValueError unless `compat` describes the memory (the fields a peer checks)."""
    kv = memory.kv
    actual = {
        "num_layers": kv.num_layers,
        "block_size": kv.block_size,
        "num_kv_heads": kv.num_kv_heads,
        "head_dim": kv.head_dim,
        "block_bytes": 2 * kv.block_bytes,
        "hidden_bytes": memory.hidden.row_bytes,
    }
    wrong = [
        f"{field}: {getattr(compat, field)} declared, {got} in the memory"
        for field, got in actual.items()
        if getattr(compat, field) != got
    ]
    if wrong:
        raise ValueError("PDCompatibility does not describe the memory: " + "; ".join(wrong))


def prepared_table(extent: MemoryExtent) -> np.ndarray:
    """Rows (address, length, device) uint64 of a side's prepared list (module docstring)."""
    blocks, rows = extent.layer_blocks, extent.hidden_rows
    table = np.empty((2 * blocks + rows, 3), dtype=np.uint64)
    steps = np.arange(blocks, dtype=np.uint64) * np.uint64(extent.block_bytes)
    table[:blocks, 0] = np.uint64(extent.key_address) + steps
    table[blocks : 2 * blocks, 0] = np.uint64(extent.value_address) + steps
    table[: 2 * blocks, 1] = extent.block_bytes
    row_steps = np.arange(rows, dtype=np.uint64) * np.uint64(extent.hidden_row_bytes)
    table[2 * blocks :, 0] = np.uint64(extent.hidden_address) + row_steps
    table[2 * blocks :, 1] = extent.hidden_row_bytes
    table[:, 2] = extent.device_id
    return table


def validate(
    partition: TransferPartition,
    hidden_rows: tuple[int, int] | None,
    local: MemoryExtent,
    remote: MemoryExtent,
) -> None:
    """ValueError unless every range lies inside both sides' registered tensors and the hidden
    row pair is given exactly when the partition carries the hidden state."""
    if partition.num_writes == 0:
        raise ValueError(f"partition {partition.sequence} writes nothing")
    if bool(partition.hidden_state_bytes) != (hidden_rows is not None):
        raise ValueError(
            f"partition {partition.sequence}: hidden_rows must be given exactly when it "
            f"carries the hidden state ({partition.hidden_state_bytes} bytes)"
        )
    if hidden_rows is not None:
        if partition.hidden_state_bytes != local.hidden_row_bytes:
            raise ValueError(
                f"hidden_state_bytes {partition.hidden_state_bytes} != a row's "
                f"{local.hidden_row_bytes} bytes"
            )
        source, target = hidden_rows
        if not 0 <= source < local.hidden_rows or not 0 <= target < remote.hidden_rows:
            raise ValueError(
                f"hidden rows {hidden_rows} outside [0, {local.hidden_rows}) x "
                f"[0, {remote.hidden_rows})"
            )
    for d in partition.descriptors:
        if (
            d.length_bytes <= 0
            or d.source_offset_bytes < 0
            or d.destination_offset_bytes < 0
            or d.source_offset_bytes + d.length_bytes > local.tensor_bytes
            or d.destination_offset_bytes + d.length_bytes > remote.tensor_bytes
        ):
            raise ValueError(f"{d} lies outside the registered {d.tensor} tensors")


def prepared_indices(
    partition: TransferPartition,
    hidden_rows: tuple[int, int] | None,
    local: MemoryExtent,
    remote: MemoryExtent,
) -> tuple[list[int], list[int]] | None:
    """Prepared-list indices (local, remote), or None when a range is not whole blocks (both
    sides have the same block bytes: the handshake checked it)."""
    block_bytes = local.block_bytes
    local_indices: list[int] = []
    remote_indices: list[int] = []
    for d in partition.descriptors:
        offsets = (d.length_bytes, d.source_offset_bytes, d.destination_offset_bytes)
        if any(offset % block_bytes for offset in offsets):
            return None
        count = d.length_bytes // block_bytes
        value = d.tensor is KVTensor.VALUE
        first_local = d.source_offset_bytes // block_bytes + (local.layer_blocks if value else 0)
        first_remote = d.destination_offset_bytes // block_bytes + (
            remote.layer_blocks if value else 0
        )
        local_indices.extend(range(first_local, first_local + count))
        remote_indices.extend(range(first_remote, first_remote + count))
    if hidden_rows is not None:
        local_indices.append(2 * local.layer_blocks + hidden_rows[0])
        remote_indices.append(2 * remote.layer_blocks + hidden_rows[1])
    return local_indices, remote_indices


def explicit_descriptors(
    partition: TransferPartition,
    hidden_rows: tuple[int, int] | None,
    local: MemoryExtent,
    remote: MemoryExtent,
) -> tuple[np.ndarray, np.ndarray]:
    """(address, length, device) uint64 rows of the partition on both sides."""
    local_base = {KVTensor.KEY: local.key_address, KVTensor.VALUE: local.value_address}
    remote_base = {KVTensor.KEY: remote.key_address, KVTensor.VALUE: remote.value_address}
    rows = len(partition.descriptors) + (hidden_rows is not None)
    local_rows = np.empty((rows, 3), dtype=np.uint64)
    remote_rows = np.empty((rows, 3), dtype=np.uint64)
    for i, d in enumerate(partition.descriptors):
        local_rows[i] = (local_base[d.tensor] + d.source_offset_bytes, d.length_bytes, 0)
        remote_rows[i] = (remote_base[d.tensor] + d.destination_offset_bytes, d.length_bytes, 0)
    if hidden_rows is not None:
        source, target = hidden_rows
        length = local.hidden_row_bytes
        local_rows[-1] = (local.hidden_address + source * local.hidden_row_bytes, length, 0)
        remote_rows[-1] = (remote.hidden_address + target * remote.hidden_row_bytes, length, 0)
    local_rows[:, 2] = local.device_id
    remote_rows[:, 2] = remote.device_id
    return local_rows, remote_rows
