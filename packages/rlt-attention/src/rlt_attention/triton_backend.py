"""Triton paged attention backend (cuda): a store kernel + the online-softmax read kernel(s).

`bind` only validates shapes and picks the tile configuration; every layer call launches the
store kernel and the read kernel(s), whose grids depend on bind-time host ints only and whose
metadata is read on the device, so a captured graph replays correctly after the runner
rewrites that metadata in place (`supports_cuda_graphs`). Calls whose groups have at most a few
queries (max_query_len x G <= SPLIT_TILE_ROWS) use the split-KV pair, longer prefill chunks the
tiled kernel (README.md, "Backends and capabilities").
"""

from __future__ import annotations

import functools

import torch
from rlt_contracts import AttentionCapabilities, KVCacheTensors, PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape, check_batch
from rlt_attention.bound_attention import BoundAttention
from rlt_attention.kv_store import SlotViews, slot_views

try:
    from rlt_attention import split_config, split_decode_kernel, triton_kernel
except ImportError as exc:  # triton is an optional platform dependency (linux only)
    split_config = split_decode_kernel = triton_kernel = None
    _TRITON_IMPORT_ERROR: str | None = f"triton not importable ({exc})"
else:
    _TRITON_IMPORT_ERROR = None

TRITON_CAPABILITIES = AttentionCapabilities(
    name="triton",
    device_types=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    max_head_dim=256,  # head dims that are not powers of two are padded (masked) to the next one
    block_size_multiple_of=1,
    supports_multi_token_queries=True,
    supports_bidirectional_prompt=True,
    supports_cuda_graphs=True,
    supports_batch_invariance=True,  # argued (see TritonPagedAttention), not measured on a GPU
    supports_fp8_kv=True,
    supports_sliding_window=True,
)

# Split-KV calls: the (query, head) rows one tile of the split kernel holds (q x G <= this).
SPLIT_TILE_ROWS = 16
# Batch-invariant mode: the tiled kernel's tile for every call (decode and prefill alike).
BATCH_INVARIANT_BLOCK_M = 64
BATCH_INVARIANT_BLOCK_N = 64


def triton_unavailable_reason() -> str | None:
    """None when the kernel module imported; otherwise why not (for selection reports)."""
    return _TRITON_IMPORT_ERROR


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host query); the H100/H200 count elsewhere."""
    if device.type != "cuda":
        return split_config.DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonPagedAttention:
    """Triton backend. `block_m` / `block_n` override the tile heuristics (tests, tuning).

    `split_kv=False` serves decode-only calls with the tiled kernel too; `num_splits` forces the
    split count of decode-only calls (tests, tuning; default: `split_config.choose_splits`).
    `fused_decode=True` stores the new keys and values inside the split kernel and merges the
    partials in its last split (an atomic ticket: one zeroed int32 per (group, kv head) per call
    shape); `store_in_split=True` moves only the store. Both measured slower: off by default.
    `batch_invariant=True` serves every call with the tiled kernel at one fixed tile, never the
    split-KV pair (README.md, "Batch-invariant mode").

    On CPU tensors it runs only when TRITON_INTERPRET=1 was set before this package was imported
    (the interpreter is for tests: slow, and bf16 `tl.dot` is wrong there).
    """

    capabilities = TRITON_CAPABILITIES

    def __init__(
        self,
        *,
        block_m: int | None = None,
        block_n: int | None = None,
        split_kv: bool = True,
        num_splits: int | None = None,
        fused_decode: bool = False,
        store_in_split: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        if triton_kernel is None:
            raise RuntimeError(_TRITON_IMPORT_ERROR)
        if batch_invariant:
            if num_splits is not None or fused_decode or store_in_split or block_m or block_n:
                raise ValueError("batch_invariant fixes the tiles and uses no split-KV decode")
            split_kv = False
            block_m, block_n = BATCH_INVARIANT_BLOCK_M, BATCH_INVARIANT_BLOCK_N
        self.batch_invariant = batch_invariant
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self._block_m = block_m
        self._block_n = block_n
        self._split_kv = split_kv
        self._num_splits = num_splits
        self._fused_decode = fused_decode
        self._store_in_split = store_in_split or fused_decode
        self._tickets: dict[tuple, torch.Tensor] = {}

    def _tickets_for(self, device: torch.device, groups: int, kv_heads: int) -> torch.Tensor:
        key = (device, groups, kv_heads)
        tickets = self._tickets.get(key)
        if tickets is None:
            tickets = self._tickets[key] = torch.zeros(
                groups, kv_heads, dtype=torch.int32, device=device
            )
        return tickets

    def bind(self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch) -> _TritonBoundAttention:
        views = slot_views(kv_cache)
        shape = check_batch(views, kv_cache.block_size, batch)
        device = kv_cache.key_cache.device
        if device.type != "cuda" and not triton_kernel.INTERPRETED:
            raise ValueError(
                f"TritonPagedAttention needs CUDA tensors, got {device} "
                "(set TRITON_INTERPRET=1 before importing rlt_attention to test on CPU)"
            )
        if kv_cache.key_cache.stride(-1) != 1 or kv_cache.value_cache.stride(-1) != 1:
            raise ValueError("KV caches must have a contiguous head dim")
        # split-KV if the queries fit a tile (rechecked per call, where the head count is known)
        split = self._split_kv and shape.max_query_len <= SPLIT_TILE_ROWS
        single = shape.max_query_len == 1
        return _TritonBoundAttention(
            kv_cache,
            views,
            batch,
            shape,
            block_m=self._block_m,
            block_n=self._block_n,
            split_decode=split,
            store_in_split=self._store_in_split and single,
            num_splits=self._num_splits,
            tickets=(
                self._tickets_for(device, shape.num_groups, kv_cache.key_cache.shape[3])
                if self._fused_decode and split and single
                else None
            ),
        )


class _TritonBoundAttention(BoundAttention):
    """Per-call attention: borrows the runner's KV tensors and the batch metadata for this call."""

    def __init__(
        self,
        kv_cache: KVCacheTensors,
        views: SlotViews,
        batch: PagedAttentionBatch,
        shape: BatchShape,
        *,
        block_m: int | None,
        block_n: int | None,
        split_decode: bool,
        store_in_split: bool,
        num_splits: int | None,
        tickets: torch.Tensor | None,
    ) -> None:
        super().__init__(views, batch, shape)
        self._kv_cache = kv_cache
        # The kernel indexes block-table rows with a unit column stride.
        self._block_tables = batch.block_tables.contiguous()
        self._block_m = block_m
        self._block_n = block_n
        self._split_decode = split_decode
        self._store_in_split = split_decode and store_in_split
        self._num_splits = num_splits
        self._tickets = tickets
        self._sm_count = _sm_count(kv_cache.key_cache.device) if split_decode else 0

    def _run(self, layer_index: int, query, key, value, window: int | None) -> torch.Tensor:
        store_in_split = self._store_in_split
        views = self._views
        scales = {}
        if views.fp8:  # the layer's scales as [1] views: no host sync
            scales = {
                "key_scale": views.key_scale[layer_index : layer_index + 1],
                "value_scale": views.value_scale[layer_index : layer_index + 1],
            }
        if not store_in_split:
            triton_kernel.launch_store_kv(
                views.key_slots[layer_index],
                views.value_slots[layer_index],
                self._batch.write_slots,
                key,
                value,
                **scales,
            )
        query = triton_kernel.unit_last_stride(query)
        out = torch.empty_like(query)
        _, num_heads, head_dim = query.shape
        kv_heads = self._views.key_slots.shape[2]
        queries = self._shape.max_query_len
        few = queries == 1 or queries * (num_heads // kv_heads) <= SPLIT_TILE_ROWS
        batch, kv = self._batch, self._kv_cache  # both launchers' positional arguments:
        tensors = (out, query, kv.key_cache[layer_index], kv.value_cache[layer_index])
        tensors += (self._block_tables, batch.query_start, batch.context_lengths)
        if self._split_decode and few and self._batch.causal:
            keys_read = self._shape.max_context_len  # the most keys a group's queries see
            if window is not None:
                keys_read = min(keys_read, window + self._shape.max_query_len - 1)
            split_decode_kernel.launch_split_decode_attention(
                *tensors,
                split=split_config.choose_splits(
                    num_groups=self._shape.num_groups,
                    num_kv_heads=kv_heads,
                    max_context_len=keys_read,
                    queries_per_kv=num_heads // kv_heads,
                    head_dim=head_dim,
                    sm_count=self._sm_count,
                    num_splits=self._num_splits,
                    block_n=self._block_n,
                    queries_per_group=self._shape.max_query_len,
                    kv_fp8=views.fp8,
                    stores_in_kernel=store_in_split or self._tickets is not None,
                ),
                new_key=key if store_in_split else None,
                new_value=value if store_in_split else None,
                write_slots=self._batch.write_slots if store_in_split else None,
                tickets=self._tickets,
                queries_per_group=self._shape.max_query_len,
                window=window,
                **scales,
            )
            return out
        triton_kernel.launch_paged_attention(
            *tensors,
            max_query_len=self._shape.max_query_len,
            tiles=triton_kernel.choose_tiles(
                max_query_len=self._shape.max_query_len,
                queries_per_kv=num_heads // kv_heads,
                head_dim=head_dim,
                block_m=self._block_m,
                block_n=self._block_n,
            ),
            causal=self._batch.causal,
            window=window,
            **scales,
        )
        return out
