"""Portable paged attention in plain torch (cpu and cuda): gather pages, then masked fp32 math.

`bind` turns the batch metadata into padded index tensors once per model call; each layer call
then does a fixed sequence of device ops (store, gather, two matmuls, softmax, unpad) with no
host sync. Memory per layer is O(S * Cmax * Hkv * D) for the gathered keys/values plus
O(S * H * Qmax * Cmax) fp32 scores (Cmax = max_context_len, Qmax = max_query_len): this is the
reference and fallback backend, not the fast path.

`TorchPagedAttention(batch_invariant=True)` computes every query row on its own: see
`_BatchInvariantAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import AttentionCapabilities, KVCacheTensors, PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape, check_batch, check_layer_inputs
from rlt_attention.kv_store import SlotViews, dequantized, slot_views, store_kv

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
)

# Batch-invariant mode: key positions per bmm step. A multiple of 64, so that the elementwise
# exp over [rows, heads, keys] never has a SIMD tail whose position depends on the batch.
KEY_CHUNK = 64
# Batch-invariant mode: query rows of one group per GEMM block (padded): a group's keys are
# gathered once per block instead of once per row.
QUERY_BLOCK = 8


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
    """

    key_slots: torch.Tensor
    key_outside_context: torch.Tensor
    key_hidden: torch.Tensor
    padded_row_of_query: torch.Tensor
    output_row_of_query: torch.Tensor


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
    slots = blocks * block_size + key_positions % block_size
    # Positions past a group's context may hold padding block ids (e.g. -1): never index them.
    slots = torch.where(key_in_context, slots, torch.zeros_like(slots))

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
        key_slots=slots.reshape(-1),
        key_outside_context=(~key_in_context)[:, :, None, None],
        key_hidden=(~key_visible)[:, None, None, :, :],
        padded_row_of_query=padded_row,
        output_row_of_query=padded_row.clamp(max=max(num_groups * max_q - 1, 0)),
    )


class TorchPagedAttention:
    """Stateless torch backend: `bind(kv_cache, batch)` -> `LayerAttention` (see module doc).

    batch_invariant: compute each query row alone (`_BatchInvariantAttention`), so its output
      depends only on its query and its own context, never on the other rows of the call.
    """

    capabilities = TORCH_CAPABILITIES

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def bind(
        self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch
    ) -> _TorchBoundAttention | _BatchInvariantAttention:
        views = slot_views(kv_cache)
        shape = check_batch(views, kv_cache.block_size, batch)
        if self.batch_invariant:
            return _BatchInvariantAttention(views, batch, shape)
        return _TorchBoundAttention(
            views, batch.write_slots, shape, build_padded_group_index(batch, shape)
        )


class _BoundAttention:
    """A `LayerAttention` valid for one call: stores the layer's new keys/values at the write
    slots, then `_attend` (the subclass's math) reads the borrowed KV views."""

    def __init__(self, views: SlotViews, write_slots: torch.Tensor, shape: BatchShape) -> None:
        self._views = views
        self._write_slots = write_slots
        self._shape = shape

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """query [N, H, D], key/value [N, Hkv, D] -> output [N, H, D] in query's dtype."""
        check_layer_inputs(self._views, self._shape.num_rows, query, key, value)
        store_kv(self._views, layer_index, self._write_slots, key, value)
        if self._shape.num_rows == 0:
            return torch.empty_like(query)
        return self._attend(layer_index, query)

    def _attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _TorchBoundAttention(_BoundAttention):
    """Per-call attention: borrowed KV views + precomputed indices, valid for this call only."""

    def __init__(
        self,
        views: SlotViews,
        write_slots: torch.Tensor,
        shape: BatchShape,
        index: PaddedGroupIndex,
    ) -> None:
        super().__init__(views, write_slots, shape)
        self._index = index

    def _attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        num_groups, max_q, max_ctx = (
            self._shape.num_groups,
            self._shape.max_query_len,
            self._shape.max_context_len,
        )
        _, num_heads, head_dim = query.shape
        kv_heads = self._views.key_slots.shape[2]
        queries_per_kv = num_heads // kv_heads
        index = self._index

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


class _BatchInvariantAttention(_BoundAttention):
    """Per-call attention in which every query row is computed as it would be alone.

    The default path pads all groups to the call's (Qmax, Cmax) and lets `torch.matmul` /
    `softmax` run over those padded shapes; on the CPU their roundings change with the shapes,
    the number of groups and even operand strides (measured: a decode row's fp32 output changed
    when another row joined the call). Here every piece of math has one shape for every call:

    1. Query blocks: each group's query rows are cut into blocks of QUERY_BLOCK consecutive rows
       (the last one padded); a block reads its group's keys and values, each of its rows sees
       the positions up to its own (causal limit; padding rows see position 0 only).
    2. Scores: one `bmm` whose every batch element is [QUERY_BLOCK * G, D] x [D, KEY_CHUNK]:
       one per (block, kv head, chunk of KEY_CHUNK key positions by absolute position).
       A GEMM of one fixed shape rounds a row the same way whatever the other rows hold, so a
       row's scores do not depend on its block's neighbours. Invisible positions get -inf.
    3. The max over a row's scores is exact; p = exp(score - max) runs over a tensor whose size
       is a multiple of 64 (no SIMD tail whose position would depend on the call).
    4. One `bmm` of elements [QUERY_BLOCK * G, KEY_CHUNK] x [KEY_CHUNK, D + 1]: p with the
       values and a column of ones (the softmax denominator comes out of the same reduction),
       per (block, kv head, chunk); the chunks' results are summed in chunk order. Positions
       a row does not see have p = 0 and finite values (keys/values outside the group's
       context are zeroed, so NaN in unread slots cannot reach the output), so they add exact
       zeros: neither the other rows of its chunk nor the number of chunks the call needs (its
       longest context) change a row's sums.
    5. output = numerator / denominator, rounded to the query dtype.

    Every bmm operand is made contiguous (a view's strides change the kernel; measured).
    Memory: O(blocks * Cmax * Hkv * D) gathered keys/values plus O(blocks * QUERY_BLOCK * H *
    Cmax) fp32 scores (Cmax rounded up to KEY_CHUNK); blocks <= groups + N / QUERY_BLOCK (a
    host bound: no sync in bind).
    """

    def __init__(self, views: SlotViews, batch: PagedAttentionBatch, shape: BatchShape) -> None:
        super().__init__(views, batch.write_slots, shape)
        device = batch.context_lengths.device
        num_rows, block_size = shape.num_rows, shape.block_size
        self._chunks = max(1, -(-shape.max_context_len // KEY_CHUNK))
        padded_context = self._chunks * KEY_CHUNK
        self._blocks = blocks = shape.num_groups + num_rows // QUERY_BLOCK
        query_start = batch.query_start.to(torch.int64)
        query_lengths = query_start[1:] - query_start[:-1]
        context_lengths = batch.context_lengths.to(torch.int64)
        first_block = torch.cumsum(-(-query_lengths // QUERY_BLOCK), 0) - (
            -(-query_lengths // QUERY_BLOCK)
        )
        rows = torch.arange(num_rows, device=device)
        group_of_row = torch.searchsorted(query_start[1:].contiguous(), rows, right=True)
        index_in_group = rows - query_start[group_of_row]
        block_of_row = first_block[group_of_row] + index_in_group // QUERY_BLOCK
        self._padded_row = block_of_row * QUERY_BLOCK + index_in_group % QUERY_BLOCK
        # Blocks no row uses read group 0's context and are never read back.
        group_of_block = torch.zeros(blocks, dtype=torch.int64, device=device)
        group_of_block.index_copy_(0, block_of_row, group_of_row)
        key_positions = torch.arange(padded_context, device=device)
        in_context = key_positions[None, :] < context_lengths[group_of_block][:, None]
        page = torch.clamp(key_positions // block_size, max=batch.block_tables.shape[1] - 1)
        table = batch.block_tables.to(torch.int64)[group_of_block][:, page]  # [blocks, Cpad]
        slots = table * block_size + key_positions % block_size
        self._key_slots = torch.where(in_context, slots, torch.zeros_like(slots))
        self._outside = ~in_context
        # Causal limit of every (block, slot) row; padding rows see position 0 only.
        limit = torch.zeros(blocks * QUERY_BLOCK, dtype=torch.int64, device=device)
        row_position = (context_lengths - query_lengths)[group_of_row] + index_in_group
        if not batch.causal:  # bidirectional groups: the limit is the context's last position
            row_position = (context_lengths - 1)[group_of_row]
        limit.index_copy_(0, self._padded_row, row_position)
        hidden = (key_positions[None, :] > limit[:, None]).view(
            blocks, QUERY_BLOCK, self._chunks, KEY_CHUNK
        )
        self._hidden = hidden.permute(0, 2, 1, 3)[:, None, :, :, None, :]

    def _gather(
        self, cache_slots: torch.Tensor, scale: torch.Tensor | None, layer_index: int
    ) -> torch.Tensor:
        """[blocks, Cpad, Hkv, D] fp32 of every block's keys (or values); zero outside each
        block's context."""
        gathered = cache_slots[layer_index].index_select(0, self._key_slots.reshape(-1))
        gathered = dequantized(gathered, scale if scale is None else scale[layer_index])
        gathered = gathered.view(self._blocks, -1, *cache_slots.shape[2:])
        return gathered.masked_fill_(self._outside[:, :, None, None], 0.0)

    def _attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        num_rows, num_heads, head_dim = query.shape
        kv_heads = self._views.key_slots.shape[2]
        group = num_heads // kv_heads
        blocks, chunks, rows = self._blocks, self._chunks, QUERY_BLOCK * group
        pieces = blocks * kv_heads * chunks  # one bmm element per (block, kv head, key chunk)
        padded = query.new_zeros((blocks * QUERY_BLOCK, num_heads, head_dim), dtype=torch.float32)
        padded.index_copy_(0, self._padded_row, query.float())
        # [blocks, QB, Hkv, G, D] -> one [QB * G, D] matrix per (block, kv head), per chunk
        q = padded.view(blocks, QUERY_BLOCK, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(blocks * kv_heads, 1, rows, head_dim).expand(-1, chunks, -1, -1)
        q = q.reshape(pieces, rows, head_dim).contiguous()
        views = self._views
        keys = self._gather(views.key_slots, views.key_scale, layer_index)  # [blocks, Cpad, Hkv, D]
        keys = keys.view(blocks, chunks, KEY_CHUNK, kv_heads, head_dim).permute(0, 3, 1, 4, 2)
        keys = keys.reshape(pieces, head_dim, KEY_CHUNK).contiguous()
        score = torch.bmm(q, keys) * head_dim**-0.5  # [pieces, QB * G, C]
        score = score.view(blocks, kv_heads, chunks, QUERY_BLOCK, group, KEY_CHUNK)
        score.masked_fill_(self._hidden, float("-inf"))
        # Every row sees position 0, so its max is finite.
        row_max = score.amax(dim=(2, 5), keepdim=True)
        probs = torch.exp(score - row_max).view(pieces, rows, KEY_CHUNK)
        values = self._gather(views.value_slots, views.value_scale, layer_index)
        values = torch.cat([values, values.new_ones(*values.shape[:3], 1)], dim=-1)
        values = values.view(blocks, chunks, KEY_CHUNK, kv_heads, head_dim + 1)
        values = values.permute(0, 3, 1, 2, 4).reshape(pieces, KEY_CHUNK, head_dim + 1)
        parts = torch.bmm(probs, values.contiguous())  # [pieces, QB * G, D + 1]
        parts = parts.view(blocks * kv_heads, chunks, rows, head_dim + 1)
        total = parts[:, 0]
        for chunk in range(1, chunks):  # in chunk order; chunks past a context add zeros
            total = total + parts[:, chunk]
        out = total[..., :head_dim] / total[..., head_dim:]
        out = out.view(blocks, kv_heads, QUERY_BLOCK, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(blocks * QUERY_BLOCK, num_heads, head_dim)
        return out.index_select(0, self._padded_row).to(query.dtype)
