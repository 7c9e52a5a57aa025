"""Byte geometry of one worker's device KV allocation, as seen by a KV transfer (no tensors).

The runner keeps separate key and value tensors shaped [L, num_blocks, block_size, Hkv, D]
(rlt-runner `KVStorage`). A transfer moves bytes, so the planner needs only each tensor's byte
strides along its layer and block axes; the inner [block_size, Hkv, D] part of one block of one
layer must be contiguous (row-major), which holds for every layout the runner allocates.
"""

from __future__ import annotations

import enum

import msgspec


class KVTensor(enum.StrEnum):
    """Which of the two KV tensors a byte range lives in. Serializes to "key" / "value"."""

    KEY = "key"
    VALUE = "value"


class KVRegion(msgspec.Struct, frozen=True):
    """Layout of one worker's key and value tensors, in elements and bytes.

    num_layers, block_size (token positions per block), num_kv_heads, head_dim: tensor shape.
    dtype_bytes: bytes per element (2 for fp16/bf16).
    key_layer_stride_bytes / key_block_stride_bytes: bytes between consecutive layers / blocks
        of the key tensor (torch `stride(i) * element_size()`); value_* likewise. Offsets built
        from them are relative to the start of that tensor's storage (`data_ptr()`).
    num_blocks: blocks a request may hold (the runner allocates one more, a scratch block that is
        never transferred); `None` when unknown, which disables block-id range checks.

    Invariant (checked): the ranges of distinct (layer, block) pairs do not overlap.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    key_layer_stride_bytes: int
    key_block_stride_bytes: int
    value_layer_stride_bytes: int
    value_block_stride_bytes: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVRegion.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"KVRegion.num_blocks must be >= 1 or None, got {self.num_blocks}")
        for tensor in KVTensor:
            self._check_strides(tensor, *self.strides_bytes(tensor))

    @classmethod
    def contiguous(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        allocated_blocks: int | None = None,
    ) -> KVRegion:
        """Region of contiguous [L, allocated_blocks, B, Hkv, D] key and value tensors.

        allocated_blocks: size of the tensors' block axis (default `num_blocks`); the runner
        allocates `num_blocks + 1` to keep a scratch block for padding rows.
        """
        allocated = num_blocks if allocated_blocks is None else allocated_blocks
        if allocated < num_blocks:
            raise ValueError(f"allocated_blocks {allocated} < num_blocks {num_blocks}")
        block_bytes = block_size * num_kv_heads * head_dim * dtype_bytes
        return cls(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
            key_layer_stride_bytes=allocated * block_bytes,
            key_block_stride_bytes=block_bytes,
            value_layer_stride_bytes=allocated * block_bytes,
            value_block_stride_bytes=block_bytes,
            num_blocks=num_blocks,
        )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token position of one layer in one tensor: Hkv * D * dtype_bytes."""
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer in one tensor (one contiguous range)."""
        return self.block_size * self.token_bytes

    def strides_bytes(self, tensor: KVTensor) -> tuple[int, int]:
        """(layer stride, block stride) of `tensor`, in bytes."""
        if tensor is KVTensor.KEY:
            return self.key_layer_stride_bytes, self.key_block_stride_bytes
        return self.value_layer_stride_bytes, self.value_block_stride_bytes

    def offset_bytes(self, tensor: KVTensor, layer: int, block: int, token: int = 0) -> int:
        """Byte offset of token `token` (0 <= token < block_size) of `block` at `layer`."""
        layer_stride, block_stride = self.strides_bytes(tensor)
        return layer * layer_stride + block * block_stride + token * self.token_bytes

    def tensor_extent_bytes(self, tensor: KVTensor) -> int:
        """Bytes from the tensor's start to the end of its last usable block (needs num_blocks)."""
        if self.num_blocks is None:
            raise ValueError("tensor_extent_bytes needs KVRegion.num_blocks")
        last = self.offset_bytes(tensor, self.num_layers - 1, self.num_blocks - 1)
        return last + self.block_bytes

    def same_geometry(self, other: KVRegion) -> bool:
        """True when one token position has the same bytes on both sides (strides may differ)."""
        return (
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype_bytes,
        ) == (
            other.num_layers,
            other.block_size,
            other.num_kv_heads,
            other.head_dim,
            other.dtype_bytes,
        )

    def _check_strides(self, tensor: KVTensor, layer_stride: int, block_stride: int) -> None:
        block_bytes = self.block_bytes
        if layer_stride < block_bytes or block_stride < block_bytes:
            raise ValueError(
                f"{tensor} strides (layer {layer_stride}, block {block_stride}) must be >= one "
                f"block of one layer ({block_bytes} bytes)"
            )
        if block_stride <= layer_stride:  # layer-major, e.g. [L, num_blocks, ...]
            if self.num_blocks is not None and layer_stride < self.num_blocks * block_stride:
                raise ValueError(
                    f"{tensor} layer stride {layer_stride} < num_blocks {self.num_blocks} x "
                    f"block stride {block_stride}: layers would overlap"
                )
        elif block_stride < self.num_layers * layer_stride:  # block-major, e.g. [num_blocks, L]
            raise ValueError(
                f"{tensor} block stride {block_stride} < num_layers {self.num_layers} x layer "
                f"stride {layer_stride}: blocks would overlap"
            )
