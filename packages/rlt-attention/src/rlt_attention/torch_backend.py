"""Portable paged attention in plain torch (cpu and cuda): gather pages, then masked fp32 math.

`bind` turns the batch metadata into padded index tensors once per model call; each layer call
then does a fixed sequence of device ops (store, gather, two matmuls, softmax, unpad) with no
host sync: the reference and fallback backend, not the fast path (README.md, "Backends and
capabilities", gives its memory and its window index). `TorchPagedAttention(batch_invariant=
True)` computes every query row on its own (`BatchInvariantAttention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from rlt_contracts import AttentionCapabilities, KVCacheTensors, PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape, check_batch
from rlt_attention.bound_attention import StoreThenAttend
from rlt_attention.kv_store import SlotViews, dequantized, slot_views
from rlt_attention.torch_invariant import BatchInvariantAttention

TORCH_CAPABILITIES = AttentionCapabilities(
    name="torch",
    device_types=("cpu", "cuda"),
    dtypes=("float32", "bfloat16", "float16"),
    max_head_dim=256,
    block_size_multiple_of=1,
    supports_multi_token_queries=True,
    supports_bidirectional_prompt=True,
    # Per-layer shapes depend on max_context_len, which grows every decode step, and bind's
    # index tensors are fresh allocations: a captured graph would replay stale indices.
    supports_cuda_graphs=False,
    supports_batch_invariance=True,
    supports_fp8_kv=True,
    supports_sliding_window=True,
)


@dataclass(frozen=True)
class PaddedGroupIndex:
    """Index tensors of one model call, built once in `bind` (all on the cache device).

    S groups are padded to Qmax query rows and Cmax key positions each.
    key_slots: [S * Cmax] int64, slot of padded key position (g, p); 0 where p >= context_len
      (the gathered value there is zeroed through `key_outside_context`).
    key_outside_context: [S, Cmax, 1, 1] bool, p >= context_lengths[g].
    key_hidden: [S, 1, 1, Qmax, Cmax] bool, True where padded query (g, i) must not see key p,
      i.e. p > context_len - q_len + i (causal limit) or p outside the context.
    padded_row_of_query: [N] int64, query row n -> g * Qmax + i for its group g and index i
      (rows past the last group, graph padding: S * Qmax, a spare row).
    output_row_of_query: the same, with the padding rows reading row S * Qmax - 1 (their
      output is unspecified).
    table_slots: [S, Cmax] int64, the slot the block table names for (g, p), garbage where the
      table holds padding (only ever read through a mask).
    key_in_context: [S, Cmax] bool, p < context_lengths[g].
    query_positions: [S, Qmax] int64, position of padded query (g, i): context_len - q_len + i.
    """

    key_slots: torch.Tensor
    key_outside_context: torch.Tensor
    key_hidden: torch.Tensor
    padded_row_of_query: torch.Tensor
    output_row_of_query: torch.Tensor
    table_slots: torch.Tensor
    key_in_context: torch.Tensor
    query_positions: torch.Tensor

    def windowed(self, window: int) -> PaddedGroupIndex:
        """This index for a layer with sliding window W: query (g, i) at position p also loses
        the keys at positions <= p - W, and the positions before group g's first visible key
        (its first query's p - W + 1) count as outside the context (slot 0, zeroed), so table
        entries of pages wholly before the window are never indexed. (A padding row past its
        group's queries may then see no key: its output, unspecified, is NaN.)"""
        max_ctx = self.table_slots.shape[1]
        key_positions = torch.arange(max_ctx, device=self.table_slots.device)
        first_visible = self.query_positions[:, :1] - (window - 1)  # [S, 1]
        key_read = self.key_in_context & (key_positions[None, :] >= first_visible)
        before_window = key_positions[None, None, :] <= self.query_positions[:, :, None] - window
        return dataclasses.replace(
            self,
            key_slots=torch.where(key_read, self.table_slots, 0).reshape(-1),
            key_outside_context=(~key_read)[:, :, None, None],
            key_hidden=self.key_hidden | before_window[:, None, None, :, :],
        )


def build_padded_group_index(batch: PagedAttentionBatch, shape: BatchShape) -> PaddedGroupIndex:
    """Device-side construction from the batch tensors; no host sync (sizes are host ints)."""
    device = batch.context_lengths.device
    max_ctx, max_q, block_size = shape.max_context_len, shape.max_query_len, shape.block_size
    query_start = batch.query_start.to(torch.int64).contiguous()
    context_lengths = batch.context_lengths.to(torch.int64)
    query_lengths = query_start[1:] - query_start[:-1]  # [S]

    key_positions = torch.arange(max_ctx, device=device)  # [Cmax]
    key_in_context = key_positions[None, :] < context_lengths[:, None]  # [S, Cmax]
    pages = batch.block_tables[:, : shape.pages_read].to(torch.int64)  # [S, P]
    blocks = pages[:, key_positions // block_size]  # [S, Cmax]
    # Positions past a group's context may hold padding block ids (e.g. -1): never index them
    # (key_slots is 0 there).
    slots = blocks * block_size + key_positions % block_size

    first_query_position = context_lengths - query_lengths  # [S]
    query_positions = first_query_position[:, None] + torch.arange(max_q, device=device)
    if batch.causal:
        key_visible = key_positions[None, None, :] <= query_positions[:, :, None]  # [S, Qmax, Cmax]
        key_visible &= key_in_context[:, None, :]
    else:  # bidirectional groups: every query sees its group's whole context
        key_visible = key_in_context[:, None, :].expand(-1, max_q, -1)

    rows = torch.arange(shape.num_rows, device=device)
    num_groups = context_lengths.shape[0]
    group_of_row = torch.searchsorted(query_start[1:], rows, right=True)
    group_of_row = group_of_row.clamp(max=max(num_groups - 1, 0))
    index_in_group = rows - query_start[group_of_row]
    # rows past the last group (graph padding) go to one spare slot after the groups' rows
    padded_row = torch.where(
        rows < query_start[-1], group_of_row * max_q + index_in_group, num_groups * max_q
    )
    return PaddedGroupIndex(
        key_slots=torch.where(key_in_context, slots, torch.zeros_like(slots)).reshape(-1),
        key_outside_context=(~key_in_context)[:, :, None, None],
        key_hidden=(~key_visible)[:, None, None, :, :],
        padded_row_of_query=padded_row,
        output_row_of_query=padded_row.clamp(max=max(num_groups * max_q - 1, 0)),
        table_slots=slots,
        key_in_context=key_in_context,
        query_positions=query_positions,
    )


class TorchPagedAttention:
    """Stateless torch backend: `bind(kv_cache, batch)` -> `LayerAttention` (see module doc).

    batch_invariant: compute each query row alone (`BatchInvariantAttention`), so its output
      depends only on its query and its own context, never on the other rows of the call.
    """

    capabilities = TORCH_CAPABILITIES

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def bind(
        self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch
    ) -> _TorchBoundAttention | BatchInvariantAttention:
        views = slot_views(kv_cache)
        shape = check_batch(views, kv_cache.block_size, batch)
        if self.batch_invariant:
            return BatchInvariantAttention(views, batch, shape)
        return _TorchBoundAttention(views, batch, shape, build_padded_group_index(batch, shape))


class _TorchBoundAttention(StoreThenAttend):
    """Per-call attention: borrowed KV views + precomputed indices, valid for this call only."""

    def __init__(
        self,
        views: SlotViews,
        batch: PagedAttentionBatch,
        shape: BatchShape,
        index: PaddedGroupIndex,
    ) -> None:
        super().__init__(views, batch, shape)
        self._index = index
        self._windowed_index: dict[int, PaddedGroupIndex] = {}  # by window, built on first use

    def _index_for(self, window: int | None) -> PaddedGroupIndex:
        if window is None:
            return self._index
        if window not in self._windowed_index:
            self._windowed_index[window] = self._index.windowed(window)
        return self._windowed_index[window]

    def _attend(self, layer_index: int, query: torch.Tensor, window: int | None) -> torch.Tensor:
        num_groups, max_q = self._shape.num_groups, self._shape.max_query_len
        max_ctx = self._shape.max_context_len
        _, num_heads, head_dim = query.shape
        kv_heads = self._views.key_slots.shape[2]
        queries_per_kv = num_heads // kv_heads
        index = self._index_for(window)

        def gather(cache_slots: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
            # [S, Cmax, Hkv, D] fp32; positions outside the context are zeroed so that whatever
            # their slot holds (NaN, another request's data) cannot reach the output.
            gathered = cache_slots[layer_index].index_select(0, index.key_slots)
            gathered = gathered.view(num_groups, max_ctx, kv_heads, head_dim)
            gathered = dequantized(gathered, scale if scale is None else scale[layer_index])
            return gathered.masked_fill_(index.key_outside_context, 0.0)

        views = self._views
        # keys [S, Hkv, D, Cmax], values [S, Hkv, Cmax, D]
        keys = gather(views.key_slots, views.key_scale).permute(0, 2, 3, 1)
        values = gather(views.value_slots, views.value_scale).permute(0, 2, 1, 3)

        # one spare row after the groups' rows takes the padding rows (PaddedGroupIndex)
        padded = query.new_zeros((num_groups * max_q + 1, num_heads, head_dim), dtype=torch.float32)
        padded.index_copy_(0, index.padded_row_of_query, query.float())
        # Head h reads kv head h // queries_per_kv: split H into (Hkv, G) without copying K/V.
        padded = padded[:-1].view(num_groups, max_q, kv_heads, queries_per_kv, head_dim)
        padded = padded.permute(0, 2, 3, 1, 4)  # [S, Hkv, G, Qmax, D]

        scores = torch.matmul(padded, keys.unsqueeze(2)) * head_dim**-0.5  # [S, Hkv, G, Qmax, Cmax]
        scores.masked_fill_(index.key_hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.unsqueeze(2))  # [S, Hkv, G, Qmax, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(num_groups * max_q, num_heads, head_dim)
        return out.index_select(0, index.output_row_of_query).to(query.dtype)
