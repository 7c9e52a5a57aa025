"""`KVStorage`: the device KV tensors and the copies on them (module M5 owns device state).

key/value tensors [L, num_blocks, block_size, Hkv, D]; a slot is block * block_size + offset.
Logical validity (which blocks a request holds) belongs to rlt-kv; this class only moves data.
With `scales` the cache is float8_e4m3fn with one key and one value scale per layer (shared by
every plane): copies, snapshots and transfers move its bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import KVCacheTensors

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVScales:
    """Per-layer scales of an fp8 KV cache (host floats; layer l stores x / scale[l])."""

    key: tuple[float, ...]
    value: tuple[float, ...]

    def tensor(self, which: str, num_layers: int, device: torch.device) -> torch.Tensor:
        values = getattr(self, which)
        if len(values) != num_layers or not all(v > 0 for v in values):
            raise ValueError(f"{which} scales: {num_layers} positive values expected, got {values}")
        return torch.tensor(values, dtype=torch.float32, device=device)


class KVStorage:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scales: KVScales | None = None,
    ) -> None:
        """`dtype`: the cache's element type (float8_e4m3fn needs `scales`)."""
        if (dtype == FP8) != (scales is not None):
            raise ValueError(f"a {FP8} KV cache needs per-layer scales, and only such a cache")
        # One extra block past the logical pool: scratch for padding rows (never allocated).
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.scales = scales
        self.tensors = KVCacheTensors(
            key_cache=torch.zeros(shape, dtype=dtype, device=device),
            value_cache=torch.zeros(shape, dtype=dtype, device=device),
            key_scale=None if scales is None else scales.tensor("key", num_layers, device),
            value_scale=None if scales is None else scales.tensor("value", num_layers, device),
        )

    def scales_tuple(self) -> tuple[float, ...]:
        """An fp8 cache's key scales then value scales (empty for a model-dtype cache)."""
        return () if self.scales is None else (*self.scales.key, *self.scales.value)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one block (all layers), in bytes."""
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.tensors.key_cache, self.tensors.value_cache
        return k.flatten(1, 2), v.flatten(1, 2)  # [L, num_blocks * B, Hkv, D]

    def copy_slots(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copy K/V of every layer from `source_slots` [M] to `target_slots` [M] (int64)."""
        for flat in self._flat():
            flat[:, target_slots] = flat[:, source_slots]

    @property
    def device(self) -> torch.device:
        return self.tensors.key_cache.device

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of blocks `block_ids` (int64, on the device) for all layers: two new
        [L, n, B, Hkv, D] tensors on the device."""
        return self.tensors.key_cache[:, block_ids], self.tensors.value_cache[:, block_ids]

    def write_blocks(
        self, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write [L, n, B, Hkv, D] keys/values (host or device) into blocks `block_ids`."""
        device = self.device
        self.tensors.key_cache[:, block_ids] = keys.to(device, non_blocking=True)
        self.tensors.value_cache[:, block_ids] = values.to(device, non_blocking=True)
