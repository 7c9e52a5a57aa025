"""The torch backend's batch-invariant mode (`TorchPagedAttention(batch_invariant=True)`): every
query row is computed as it would be alone (see `BatchInvariantAttention`)."""

from __future__ import annotations

import torch
from rlt_contracts import PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape
from rlt_attention.bound_attention import StoreThenAttend
from rlt_attention.kv_store import SlotViews, dequantized

# Batch-invariant mode: key positions per bmm step. A multiple of 64, so that the elementwise
# exp over [rows, heads, keys] never has a SIMD tail whose position depends on the batch.
KEY_CHUNK = 64
# Batch-invariant mode: query rows of one group per GEMM block (padded): a group's keys are
# gathered once per block instead of once per row.
QUERY_BLOCK = 8


class BatchInvariantAttention(StoreThenAttend):
    """Per-call attention in which every query row is computed as it would be alone.

    Every piece of math has one shape for every call: each group's query rows in blocks of
    QUERY_BLOCK, scores as one `bmm` of [QUERY_BLOCK * G, D] x [D, KEY_CHUNK] elements per
    (block, kv head, chunk of key positions by absolute position), an exact max, and one `bmm`
    of p with the values and a column of ones (the softmax denominator), summed over chunks in
    chunk order. README.md, "Batch-invariant mode", says why a row's sums then depend on nothing
    else in the call (a sliding window, `_masks_for`, only hides more positions) and what it
    costs. Every bmm operand is made contiguous (a view's strides change the kernel; measured).

    Memory: O(blocks * Cmax * Hkv * D) gathered keys/values plus O(blocks * QUERY_BLOCK * H *
    Cmax) fp32 scores (Cmax rounded up to KEY_CHUNK); blocks <= groups + N / QUERY_BLOCK (a
    host bound: no sync in bind).
    """

    def __init__(self, views: SlotViews, batch: PagedAttentionBatch, shape: BatchShape) -> None:
        super().__init__(views, batch, shape)
        device = batch.context_lengths.device
        num_rows, block_size = shape.num_rows, shape.block_size
        self._chunks = max(1, -(-shape.max_context_len // KEY_CHUNK))
        padded_context = self._chunks * KEY_CHUNK
        self._blocks = blocks = shape.num_groups + num_rows // QUERY_BLOCK
        query_start = batch.query_start.to(torch.int64)
        query_lengths = query_start[1:] - query_start[:-1]
        context_lengths = batch.context_lengths.to(torch.int64)
        group_blocks = -(-query_lengths // QUERY_BLOCK)
        first_block = torch.cumsum(group_blocks, 0) - group_blocks
        rows = torch.arange(num_rows, device=device)
        group_of_row = torch.searchsorted(query_start[1:].contiguous(), rows, right=True)
        index_in_group = rows - query_start[group_of_row]
        block_of_row = first_block[group_of_row] + index_in_group // QUERY_BLOCK
        self._padded_row = block_of_row * QUERY_BLOCK + index_in_group % QUERY_BLOCK
        # Blocks no row uses read group 0's context and are never read back.
        group_of_block = torch.zeros(blocks, dtype=torch.int64, device=device)
        group_of_block.index_copy_(0, block_of_row, group_of_row)
        self._key_positions = key_positions = torch.arange(padded_context, device=device)
        self._in_context = key_positions[None, :] < context_lengths[group_of_block][:, None]
        page = torch.clamp(key_positions // block_size, max=batch.block_tables.shape[1] - 1)
        table = batch.block_tables.to(torch.int64)[group_of_block][:, page]  # [blocks, Cpad]
        # garbage where the table holds padding (-1): only ever read through a mask
        self._table_slots = table * block_size + key_positions % block_size
        self._block_used = torch.zeros(blocks, dtype=torch.bool, device=device)
        self._block_used[block_of_row] = True
        # Causal limit of every (block, slot) row; padding rows see position 0 only.
        self._limit = limit = torch.zeros(blocks * QUERY_BLOCK, dtype=torch.int64, device=device)
        row_position = (context_lengths - query_lengths)[group_of_row] + index_in_group
        if not batch.causal:  # bidirectional groups: the limit is the context's last position
            row_position = (context_lengths - 1)[group_of_row]
        limit.index_copy_(0, self._padded_row, row_position)
        self._masks = {
            None: self._key_masks(self._in_context, key_positions[None, :] > limit[:, None])
        }

    def _key_masks(
        self, key_read: torch.Tensor, row_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots [blocks * Cpad], outside [blocks, Cpad, 1, 1], hidden) from the positions a
        block reads [blocks, Cpad] and those each (block, slot) row does not see
        [blocks * QUERY_BLOCK, Cpad]; hidden is laid out as the scores."""
        slots = torch.where(key_read, self._table_slots, 0).reshape(-1)
        hidden = row_hidden.view(self._blocks, QUERY_BLOCK, self._chunks, KEY_CHUNK)
        return (
            slots,
            (~key_read)[:, :, None, None],
            hidden.permute(0, 2, 1, 3)[:, None, :, :, None, :],
        )

    def _masks_for(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key masks of a layer with sliding window W (built on first use): a row at p
        also loses the keys <= p - W; a block reads from its first row's first visible key
        on (its lowest), and unused blocks read nothing, so table entries of pages wholly
        before the window are never indexed. Hidden keys get p = 0 against finite (zeroed or
        real) values, so the window keeps a row's sums independent of its block and chunk."""
        if window not in self._masks:
            positions, limit = self._key_positions[None, :], self._limit
            first_visible = limit.view(self._blocks, QUERY_BLOCK)[:, :1] - (window - 1)
            key_read = self._in_context & self._block_used[:, None] & (positions >= first_visible)
            row_hidden = (positions > limit[:, None]) | (positions <= limit[:, None] - window)
            self._masks[window] = self._key_masks(key_read, row_hidden)
        return self._masks[window]

    def _gather(
        self,
        cache_slots: torch.Tensor,
        scale: torch.Tensor | None,
        layer_index: int,
        key_slots: torch.Tensor,
        outside: torch.Tensor,
    ) -> torch.Tensor:
        """[blocks, Cpad, Hkv, D] fp32 of every block's keys (or values); zero where `outside`
        (past each block's context, or before its window)."""
        gathered = cache_slots[layer_index].index_select(0, key_slots)
        gathered = dequantized(gathered, scale if scale is None else scale[layer_index])
        gathered = gathered.view(self._blocks, -1, *cache_slots.shape[2:])
        return gathered.masked_fill_(outside, 0.0)

    def _attend(self, layer_index: int, query: torch.Tensor, window: int | None) -> torch.Tensor:
        key_slots, outside, hidden = self._masks_for(window)
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
        # [blocks, Cpad, Hkv, D]
        keys = self._gather(views.key_slots, views.key_scale, layer_index, key_slots, outside)
        keys = keys.view(blocks, chunks, KEY_CHUNK, kv_heads, head_dim).permute(0, 3, 1, 4, 2)
        keys = keys.reshape(pieces, head_dim, KEY_CHUNK).contiguous()
        score = torch.bmm(q, keys) * head_dim**-0.5  # [pieces, QB * G, C]
        score = score.view(blocks, kv_heads, chunks, QUERY_BLOCK, group, KEY_CHUNK)
        score.masked_fill_(hidden, float("-inf"))
        # Every row sees its own position (padding rows position 0), so its max is finite.
        row_max = score.amax(dim=(2, 5), keepdim=True)
        probs = torch.exp(score - row_max).view(pieces, rows, KEY_CHUNK)
        values = self._gather(views.value_slots, views.value_scale, layer_index, key_slots, outside)
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
