"""Write side shared by every backend: store a call's keys/values at their slots of one layer.

The runner owns the KV tensors (`KVCacheTensors`); a bound attention only writes the slots the
batch names (`PagedAttentionBatch.write_slots`) of the layer it is called for, and reads them back
in the same call. Nothing else in the cache is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import KVCacheTensors


@dataclass(frozen=True)
class SlotViews:
    """Slot-major views of the runner's KV tensors (no copy; writes go to the runner's storage).

    key_slots / value_slots: [L, num_blocks * block_size, Hkv, D], cache dtype and device, where
    slot = block_id * block_size + offset.
    """

    key_slots: torch.Tensor
    value_slots: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.key_slots.shape[1])


def slot_views(kv_cache: KVCacheTensors) -> SlotViews:
    """Validate the cache layout and return slot-major views of it.

    Raises ValueError when key/value caches disagree in shape, dtype or device, or when a cache
    cannot be viewed slot-major without a copy (a copy would silently drop every write).
    """
    key_cache, value_cache = kv_cache.key_cache, kv_cache.value_cache
    if key_cache.dim() != 5:
        raise ValueError(
            f"key_cache must be [L, num_blocks, block_size, Hkv, D], got {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value cache shapes differ: {tuple(key_cache.shape)} vs {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise ValueError("key/value caches must share dtype and device")
    layers, blocks, block_size, kv_heads, head_dim = key_cache.shape
    shape = (layers, blocks * block_size, kv_heads, head_dim)
    try:
        return SlotViews(key_cache.view(shape), value_cache.view(shape))
    except RuntimeError as exc:
        raise ValueError(f"KV caches must be viewable as {shape} without a copy: {exc}") from exc


def store_kv(
    views: SlotViews,
    layer_index: int,
    write_slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write key/value [N, Hkv, D] at `write_slots` [N] int64 of layer `layer_index`.

    Values are cast to the cache dtype. Asynchronous on CUDA (no host sync); the caller's stream
    orders the following read after it. Slots must be distinct (index_copy_ leaves duplicates'
    winner unspecified).
    """
    if write_slots.shape[0] == 0:
        return
    cache_dtype = views.key_slots.dtype
    views.key_slots[layer_index].index_copy_(0, write_slots, key.to(cache_dtype))
    views.value_slots[layer_index].index_copy_(0, write_slots, value.to(cache_dtype))
