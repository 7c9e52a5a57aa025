"""Optional adapter to flash-attn 2's `flash_attn_varlen_func` with a paged KV cache.

UNVERIFIED: flash-attn has no wheels and is not installed on any machine this package was
developed or tested on, so this adapter has never run. It is written against flash-attn 2's
documented interface (paged KV through `block_table`, bottom-right aligned `causal=True`, which
is exactly this contract's "queries are the last q_len positions of the context"). Selection
never picks it under "auto"; it is used only when asked for by name and when `import flash_attn`
succeeds and its `flash_attn_varlen_func` accepts `block_table` (a capability probe, not a
version check, R13).

Declared limits follow flash-attn 2's own checks: cuda, fp16/bf16, head_dim <= 256, and a paged
block size divisible by 256. The engine's default block size is 16, so asking for this backend
by name also needs `block_size=256` (or another multiple); otherwise selection raises a
`ConfigurationError` naming `attention_backend` + `block_size`. It declares no CUDA-graph
capture (not established), so with graphs requested its decode runs eagerly, with a warning.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.nn.functional as F
from rlt_contracts import AttentionCapabilities, KVCacheTensors, PagedAttentionBatch

from rlt_attention.batch_shape import check_batch, check_layer_inputs
from rlt_attention.kv_store import slot_views, store_kv

FLASH_ATTN_CAPABILITIES = AttentionCapabilities(
    name="flash_attn",
    device_types=("cuda",),
    dtypes=("bfloat16", "float16"),
    max_head_dim=256,
    block_size_multiple_of=256,
    supports_multi_token_queries=True,
    supports_cuda_graphs=False,  # not established for this adapter
)


@functools.cache
def _probe_flash_attn() -> tuple[object | None, str | None]:
    """(flash_attn_varlen_func, None) when usable, else (None, reason). Imported at most once."""
    try:
        module = importlib.import_module("flash_attn")  # optional extra `rlt-attention[flash-attn]`
    except (ImportError, OSError) as exc:
        return None, (
            f"flash-attn is not importable here ({type(exc).__name__}: {exc}); it is the "
            "optional extra rlt-attention[flash-attn] (no wheels: built from source on CUDA)"
        )
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if varlen is None:
        return None, "flash_attn has no flash_attn_varlen_func"
    try:
        parameters = inspect.signature(varlen).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "block_table" not in parameters:
        return None, "flash_attn_varlen_func takes no block_table (no paged KV in this build)"
    return varlen, None


def flash_attn_unavailable_reason() -> str | None:
    """None when the adapter can run here; otherwise why not (for selection reports)."""
    return _probe_flash_attn()[1]


class FlashAttnBackend:
    """Stateless, UNVERIFIED adapter (module doc). RuntimeError where flash_attn is absent."""

    capabilities = FLASH_ATTN_CAPABILITIES

    def __init__(self, *, batch_invariant: bool = False) -> None:
        if batch_invariant:
            raise ValueError("flash_attn has no batch-invariant mode")
        varlen, reason = _probe_flash_attn()
        if varlen is None:
            raise RuntimeError(reason)
        self._varlen = varlen

    def bind(self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch):
        views = slot_views(kv_cache)
        shape = check_batch(views, kv_cache.block_size, batch)
        # cu_seqlens_k [S + 1] int32: flash-attn reads group g's key count as the difference.
        cu_seqlens_k = F.pad(torch.cumsum(batch.context_lengths, 0, dtype=torch.int32), (1, 0))
        varlen = self._varlen

        def attention(layer_index: int, query, key, value):
            """query [N, H, D], key/value [N, Hkv, D] (cuda, fp16/bf16) -> [N, H, D]."""
            check_layer_inputs(views, shape.num_rows, query, key, value)
            store_kv(views, layer_index, batch.write_slots, key, value)
            key_cache = kv_cache.key_cache[layer_index]  # [num_blocks, block_size, Hkv, D]
            out = varlen(
                query.to(key_cache.dtype),
                key_cache,
                kv_cache.value_cache[layer_index],
                cu_seqlens_q=batch.query_start,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=shape.max_query_len,
                max_seqlen_k=shape.max_context_len,
                softmax_scale=query.shape[-1] ** -0.5,
                causal=True,
                block_table=batch.block_tables,
            )
            return out.to(query.dtype)

        return attention
