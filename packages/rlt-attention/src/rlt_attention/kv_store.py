"""Write side shared by every backend: store a call's keys/values at their slots of one layer.

The runner owns the KV tensors (`KVCacheTensors`); a bound attention only writes the slots the
batch names (`PagedAttentionBatch.write_slots`) of the layer it is called for, and reads them back
in the same call. Nothing else in the cache is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import KVCacheTensors

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


@dataclass(frozen=True)
class SlotViews:
    """Slot-major views of the runner's KV tensors (no copy; writes go to the runner's storage).

    key_slots / value_slots: [L, num_blocks * block_size, Hkv, D], cache dtype and device, where
    slot = block_id * block_size + offset. key_scale / value_scale: fp32 [L] for an fp8 cache
    (stored = round(x / scale[layer]); `dequantized` reads back stored * scale[layer]), else None.
    """

    key_slots: torch.Tensor
    value_slots: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.key_scale is not None


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
    scales = (kv_cache.key_scale, kv_cache.value_scale)
    if any((key_cache.dtype == FP8) != (scale is not None) for scale in scales):
        raise ValueError(
            f"a {FP8} cache needs key and value scales, and only such a cache has them"
        )
    for scale in scales:
        if scale is not None and (
            scale.shape != (key_cache.shape[0],) or scale.dtype != torch.float32
        ):
            raise ValueError(
                f"KV scales must be fp32 [{key_cache.shape[0]}] (one per layer), got "
                f"{scale.dtype} {tuple(scale.shape)}"
            )
    layers, blocks, block_size, kv_heads, head_dim = key_cache.shape
    shape = (layers, blocks * block_size, kv_heads, head_dim)
    try:
        return SlotViews(key_cache.view(shape), value_cache.view(shape), *scales)
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

    Values are cast to the cache dtype (an fp8 cache: divided by the layer's scale, saturated
    to +-448, rounded to nearest). Asynchronous on CUDA (no host sync); the caller's stream
    orders the following read after it. Slots must be distinct (index_copy_ leaves duplicates'
    winner unspecified).
    """
    if write_slots.shape[0] == 0:
        return
    if views.fp8:  # index_copy_ has no fp8 kernel on the CPU: the bytes are copied as uint8
        for slots, scale, x in (
            (views.key_slots, views.key_scale, key),
            (views.value_slots, views.value_scale, value),
        ):
            stored = quantize(x, scale[layer_index])
            slots[layer_index].view(torch.uint8).index_copy_(
                0, write_slots, stored.view(torch.uint8)
            )
        return
    cache_dtype = views.key_slots.dtype
    views.key_slots[layer_index].index_copy_(0, write_slots, key.to(cache_dtype))
    views.value_slots[layer_index].index_copy_(0, write_slots, value.to(cache_dtype))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to e4m3's range and rounded to nearest (the fp8 cache's write)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantized(slots: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache entries as fp32: times the layer's scale (0-d) for an fp8 cache."""
    return slots.float() if scale is None else slots.float() * scale
