"""`KVStorage`: the device KV tensors and the copies on them (module M5 owns device state).

key/value tensors [L, num_blocks, block_size, Hkv, D]; a slot is block * block_size + offset.
Logical validity (which blocks a request holds) belongs to rlt-kv; this class only moves data.
"""

from __future__ import annotations

import torch
from rlt_contracts import KVCacheTensors


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
    ) -> None:
        # One extra block past the logical pool: scratch for padding rows (never allocated).
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.tensors = KVCacheTensors(
            key_cache=torch.zeros(shape, dtype=dtype, device=device),
            value_cache=torch.zeros(shape, dtype=dtype, device=device),
        )

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
