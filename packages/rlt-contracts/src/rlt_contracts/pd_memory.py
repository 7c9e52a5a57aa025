"""What a runner exposes for PD (RFC M9, worker side): the device memory a KV transport
registers and the row that holds a request's prompt state. Addresses, sizes and layout, no
tensors: the transport (rlt-pd) and the engine's PD wiring read nothing else of the runner.

KV pool: one key and one value allocation, each contiguous row-major [L, A, B, Hkv, D] (L layers,
A = allocated blocks: the pool's blocks, then `scratch_blocks` that are never a transfer target,
B positions per block). Every plane keeps its blocks in these two allocations: a plane is a set
of blocks (a request has one block table per plane, `HandoffTarget.block_tables`), so a
transport moves the pages of any plane alike. Planes 0 .. num_planes - 1 are the KV layout's loop
planes, then the stage plane (`stage_plane`) of a family whose prelude and coda layers keep KV
(they use layer slots 0.. of its blocks). Position p of block b at layer l starts at byte

    ((l * A + b) * B + p) * Hkv * D * element_bytes      of either allocation.

Hidden rows: one contiguous [S, d] allocation, row r at byte r * row_bytes. On a prefill
instance they are the rows' loop state (a request's final prompt state is read from its row);
on a decode instance the landing buffer, which P writes (decode ticks rewrite the state; the
runner copies a landed row into it when the request starts).

Lifetime: the memory stays allocated until the runner is closed; whoever registers it
deregisters it first (the engine core closes its handoff port before its runner).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from rlt_contracts.pd import PDRole
from rlt_contracts.requests import ExecutionIdentity


class MemoryRegion(msgspec.Struct, frozen=True):
    """One contiguous allocation: `device` "cpu" or "cuda" (index `device_index`)."""

    address: int
    size_bytes: int
    device: str
    device_index: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"memory on {self.device!r}: only cpu and cuda register")
        if self.address <= 0 or self.size_bytes <= 0:
            raise ValueError(f"empty region: address {self.address}, {self.size_bytes} bytes")


class KVPoolMemory(msgspec.Struct, frozen=True):
    """The KV pool's key and value allocations (module doc). `dtype`: the element type's name
    ("bfloat16", "float8_e4m3fn"); `scales`: an fp8 cache's per-layer key scales then value
    scales (empty otherwise): its bytes mean the same on two sides only with equal scales."""

    key: MemoryRegion
    value: MemoryRegion
    num_layers: int
    allocated_blocks: int
    scratch_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_bytes: int
    num_planes: int
    stage_plane: int | None = None
    scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        expected = self.num_layers * self.allocated_blocks * self.block_bytes
        for name, region in (("key", self.key), ("value", self.value)):
            if region.size_bytes != expected:
                raise ValueError(
                    f"{name} allocation holds {region.size_bytes} bytes, [L, A, B, Hkv, D] = "
                    f"{self.num_layers, self.allocated_blocks, self.block_size}"
                    f"{self.num_kv_heads, self.head_dim} x {self.element_bytes} needs {expected}"
                )
        if (self.key.device, self.key.device_index) != (self.value.device, self.value.device_index):
            raise ValueError("key and value allocations on different devices")
        if not 0 <= self.scratch_blocks < self.allocated_blocks:
            raise ValueError(f"scratch_blocks {self.scratch_blocks} of {self.allocated_blocks}")
        if self.stage_plane is not None and self.stage_plane != self.num_planes - 1:
            raise ValueError(f"the stage plane is the last of {self.num_planes} planes")

    @property
    def num_blocks(self) -> int:
        """Blocks a request may hold (the scratch blocks excluded)."""
        return self.allocated_blocks - self.scratch_blocks

    @property
    def token_bytes(self) -> int:
        """One position of one layer in one allocation."""
        return self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def block_bytes(self) -> int:
        """One block of one layer in one allocation (contiguous)."""
        return self.block_size * self.token_bytes

    def offset_bytes(self, layer: int, block: int, position: int = 0) -> int:
        """Where position `position` (< block_size) of `block` at `layer` starts."""
        return (layer * self.allocated_blocks + block) * self.block_bytes + (
            position * self.token_bytes
        )


class HiddenRowsMemory(msgspec.Struct, frozen=True):
    """The [S, d] hidden-state rows of one role (module doc); `dtype` as `KVPoolMemory`'s."""

    region: MemoryRegion
    num_rows: int
    row_bytes: int
    dtype: str

    def __post_init__(self) -> None:
        if self.region.size_bytes != self.num_rows * self.row_bytes:
            raise ValueError(
                f"hidden rows: {self.region.size_bytes} bytes for {self.num_rows} rows of "
                f"{self.row_bytes}"
            )

    def row_address(self, row: int) -> int:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} not in [0, {self.num_rows})")
        return self.region.address + row * self.row_bytes


class PDMemory(msgspec.Struct, frozen=True):
    """All a KV transport registers for one role: the KV pool and that role's hidden rows."""

    kv: KVPoolMemory
    hidden: HiddenRowsMemory

    def __post_init__(self) -> None:
        here = (self.kv.key.device, self.kv.key.device_index)
        if here != (self.hidden.region.device, self.hidden.region.device_index):
            raise ValueError("the KV pool and the hidden rows are on different devices")


class PDMemorySource(Protocol):
    """What a runner exposes for PD (rlt-runner's `PDRegions`); the engine's PD wiring uses
    this and nothing else of the runner's device state."""

    def memory(self, role: PDRole) -> PDMemory:
        """The memory a `role` instance registers (PREFILL: the rows' state, the final prompt
        state's source; DECODE: the landing buffer). ValueError for `PDRole.NONE`."""
        ...

    def hidden_row(self, identity: ExecutionIdentity) -> int | None:
        """The row of `PDMemory.hidden` that holds the request's state, or None when the
        request has no row (never admitted, or dropped after its step failed)."""
        ...
