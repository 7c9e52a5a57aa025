"""`PDRegions`: the runner's side of PD (`rlt_contracts.PDMemorySource`): its KV pool and
hidden-state rows as addresses and layout for a KV transport to register, and the row of a
request. Nothing else of the runner's device state leaves it for PD."""

from __future__ import annotations

import torch
from rlt_contracts import (
    ExecutionIdentity,
    HiddenRowsMemory,
    KVPoolMemory,
    MemoryRegion,
    PDMemory,
    PDRole,
)

from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_state import DecodeRows


def memory_region(name: str, tensor: torch.Tensor) -> MemoryRegion:
    """The allocation under `tensor`, which must be contiguous (a strided view is no one
    region: a transport would address the wrong bytes)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tensor.stride()})")
    return MemoryRegion(
        address=tensor.data_ptr(),
        size_bytes=tensor.numel() * tensor.element_size(),
        device=tensor.device.type,
        device_index=tensor.device.index or 0,
    )


def pd_memory(
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    *,
    scratch_blocks: int,
    num_planes: int,
    stage_plane: int | None = None,
    scales: tuple[float, ...] = (),
) -> PDMemory:
    """The declaration of key and value caches [L, A, B, Hkv, D] and hidden rows [S, d]
    (benchmarks declare their own tensors with it)."""
    num_layers, allocated, block_size, heads, head_dim = keys.shape
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"value_cache {tuple(values.shape)} {values.dtype} is not like key_cache")
    return PDMemory(
        kv=KVPoolMemory(
            key=memory_region("key_cache", keys),
            value=memory_region("value_cache", values),
            num_layers=num_layers,
            allocated_blocks=allocated,
            scratch_blocks=scratch_blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=str(keys.dtype).removeprefix("torch."),
            element_bytes=keys.element_size(),
            num_planes=num_planes,
            stage_plane=stage_plane,
            scales=scales,
        ),
        hidden=HiddenRowsMemory(
            region=memory_region("hidden rows", hidden),
            num_rows=hidden.shape[0],
            row_bytes=hidden.shape[1] * hidden.element_size(),
            dtype=str(hidden.dtype).removeprefix("torch."),
        ),
    )


class PDRegions:
    def __init__(self, kv: KVStorage, rows: DecodeRows) -> None:
        self._kv = kv
        self._rows = rows

    def memory(self, role: PDRole) -> PDMemory:
        if role is PDRole.NONE:
            raise ValueError("an engine without a PD role registers no memory")
        kv, rows = self._kv, self._rows
        keys = kv.tensors.key_cache
        return pd_memory(
            keys,
            kv.tensors.value_cache,
            rows.hidden if role is PDRole.PREFILL else rows.landing,
            scratch_blocks=keys.shape[1] - kv.scratch_block,
            num_planes=rows.num_planes,
            stage_plane=rows.stage_plane,
            scales=kv.scales_tuple(),
        )

    def hidden_row(self, identity: ExecutionIdentity) -> int | None:
        return self._rows.record(identity).row if identity in self._rows else None
