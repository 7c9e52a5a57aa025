"""Optional adapter to flash-attn 2's paged-KV forward: `flash_attn_with_kvcache` for decode,
`flash_attn_varlen_func` for prefill and mixed calls (README.md, "Backends and capabilities",
has its limits, its causal and window mapping and how it is built and tested; checked against
flash-attn 2.8.3.post2's sources). Selection never picks it under "auto"; it is used only when
asked for by name and when `import flash_attn` succeeds and both functions take a `block_table`
(a capability probe, not a version check, R13).

- KV: one layer of the runner's cache, [num_blocks, block_size, Hkv, D], is flash-attn's paged
  k/v cache as is (no copy); block tables are int32 with a unit last stride. Only the first
  ceil(max_context_len / block_size) table columns are passed (a view): the decode kernel
  sizes its KV splits by the table's width.
- Decode-only calls (every group one query): `flash_attn_with_kvcache(q [S, 1, H, D],
  cache_seqlens=context_lengths, block_table=...)`, its KV splits chosen from the SM count
  (`num_splits=0`; a constructor argument overrides it). One query per group: no causal mask.
- Other calls: `flash_attn_varlen_func(q [N, H, D], cu_seqlens_q=query_start, cu_seqlens_k=
  [0, cumsum(context_lengths)], causal=True, block_table=...)`; with a block table only the
  context lengths (the differences of cu_seqlens_k) matter.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from rlt_contracts import AttentionCapabilities, KVCacheTensors, PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape, check_batch
from rlt_attention.bound_attention import StoreThenAttend
from rlt_attention.kv_store import SlotViews, slot_views

FLASH_ATTN_CAPABILITIES = AttentionCapabilities(
    name="flash_attn",
    device_types=("cuda",),
    dtypes=("bfloat16", "float16"),
    max_head_dim=256,
    block_size_multiple_of=256,
    supports_multi_token_queries=True,
    supports_cuda_graphs=False,  # not established for this adapter
    supports_sliding_window=True,  # window_size=(W - 1, 0)
)

# Keyword arguments this adapter passes, per function (the probe checks that they exist).
_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale")
_VARLEN_ARGS += ("causal", "block_table", "window_size")
_KVCACHE_ARGS = ("cache_seqlens", "block_table", "softmax_scale", "causal", "num_splits")
_KVCACHE_ARGS += ("window_size",)


class FlashAttnApi(NamedTuple):
    varlen: object  # flash_attn.flash_attn_varlen_func
    with_kvcache: object  # flash_attn.flash_attn_with_kvcache


@functools.cache
def _probe_flash_attn() -> tuple[FlashAttnApi | None, str | None]:
    """(FlashAttnApi, None) when usable, else (None, reason). Imported at most once."""
    try:
        module = importlib.import_module("flash_attn")  # optional extra `rlt-attention[flash-attn]`
    except (ImportError, OSError) as exc:
        return None, (
            f"flash-attn is not importable here ({type(exc).__name__}: {exc}); it is the "
            "optional extra rlt-attention[flash-attn] (no wheels: built from source on CUDA)"
        )
    functions = []
    for name, needed in (
        ("flash_attn_varlen_func", _VARLEN_ARGS),
        ("flash_attn_with_kvcache", _KVCACHE_ARGS),
    ):
        function = getattr(module, name, None)
        if function is None:
            return None, f"flash_attn has no {name}"
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):
            parameters = {}
        missing = [arg for arg in needed if arg not in parameters]
        if missing:
            return None, f"flash_attn.{name} takes no {', '.join(missing)} (no paged KV here)"
        functions.append(function)
    return FlashAttnApi(*functions), None


def flash_attn_unavailable_reason() -> str | None:
    """None when the adapter can run here; otherwise why not (for selection reports)."""
    return _probe_flash_attn()[1]


class FlashAttnBackend:
    """Stateless adapter (module doc). RuntimeError where flash_attn is absent.

    num_splits: KV splits of decode-only calls, passed to `flash_attn_with_kvcache`; 0 (the
      default) lets flash-attn choose from the batch, heads, context and SM count.
    """

    capabilities = FLASH_ATTN_CAPABILITIES

    def __init__(self, *, batch_invariant: bool = False, num_splits: int = 0) -> None:
        if batch_invariant:
            raise ValueError("flash_attn has no batch-invariant mode")
        if num_splits < 0:
            raise ValueError(f"num_splits must be >= 0, got {num_splits}")
        api, reason = _probe_flash_attn()
        if api is None:
            raise RuntimeError(reason)
        self._api = api
        self._num_splits = num_splits

    def bind(self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch):
        views = slot_views(kv_cache)
        shape = check_batch(views, kv_cache.block_size, batch)
        if kv_cache.block_size % FLASH_ATTN_CAPABILITIES.block_size_multiple_of:
            raise ValueError(
                f"flash_attn needs a block size divisible by 256, got {kv_cache.block_size}"
            )
        return _FlashAttnBoundAttention(self._api, self._num_splits, kv_cache, views, batch, shape)


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    """flash-attn's index tensors: int32 with a unit last stride (a no-op for the contract's)."""
    if tensor.dtype != torch.int32:
        tensor = tensor.to(torch.int32)
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


class _FlashAttnBoundAttention(StoreThenAttend):
    """Per-call attention: borrowed KV tensors + the call's flash-attn arguments (built in bind,
    on the device, without a host sync)."""

    def __init__(
        self,
        api: FlashAttnApi,
        num_splits: int,
        kv_cache: KVCacheTensors,
        views: SlotViews,
        batch: PagedAttentionBatch,
        shape: BatchShape,
    ) -> None:
        super().__init__(views, batch, shape)
        self._api = api
        self._num_splits = num_splits
        self._kv_cache = kv_cache
        # Decode-only: every group one query row (flash_attn_with_kvcache's fixed q length 1).
        self._decode = shape.max_query_len == 1 and shape.num_rows == shape.num_groups
        self._block_table = _int32(batch.block_tables[:, : max(shape.pages_read, 1)])
        self._context_lengths = _int32(batch.context_lengths)
        if not self._decode:
            self._cu_seqlens_q = _int32(batch.query_start)
            self._cu_seqlens_k = F.pad(
                torch.cumsum(batch.context_lengths, 0, dtype=torch.int32), (1, 0)
            )

    def _attend(self, layer_index: int, query: torch.Tensor, window: int | None) -> torch.Tensor:
        """cuda fp16/bf16 only (`window`: a sliding-window layer's W)."""
        windowed = {} if window is None else {"window_size": (window - 1, 0)}
        key_cache = self._kv_cache.key_cache[layer_index]  # [num_blocks, block_size, Hkv, D]
        value_cache = self._kv_cache.value_cache[layer_index]
        q = query.to(key_cache.dtype)
        scale = query.shape[-1] ** -0.5
        if self._decode:
            out = self._api.with_kvcache(
                q.unsqueeze(1),  # [S, 1, H, D]
                key_cache,
                value_cache,
                cache_seqlens=self._context_lengths,
                block_table=self._block_table,
                softmax_scale=scale,
                causal=False,  # one query per group sees its whole context (or window)
                num_splits=self._num_splits,
                **windowed,
            ).squeeze(1)
        else:
            out = self._api.varlen(
                q,
                key_cache,
                value_cache,
                cu_seqlens_q=self._cu_seqlens_q,
                cu_seqlens_k=self._cu_seqlens_k,
                max_seqlen_q=self._shape.max_query_len,
                max_seqlen_k=self._shape.max_context_len,
                softmax_scale=scale,
                causal=True,  # bottom-right aligned: queries are the context's last q_len
                block_table=self._block_table,
                **windowed,
            )
        return out.to(query.dtype)
