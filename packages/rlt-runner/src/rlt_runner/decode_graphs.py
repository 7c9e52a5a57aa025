"""CUDA graphs of the decode recurrent step: one graph per padded row count (bucket).

A decode step is one loop of L layers for R rows; eager execution launches ~50 small kernels
per layer from Python, so the host, not the GPU, bounds its speed. A captured graph replays the
whole loop with one launch. Inputs live in static buffers that every replay overwrites in
place: hidden [B, d], positions [B], and the attention metadata (context lengths, block tables
of the full context width, write slots). Rows R..B of a bucket are padding: position 0, context
length 1, and every page and the write slot point at a scratch block the logical KV manager
never hands out, so padding writes and reads only scratch and never touches a request's KV.

Requires an attention backend that declares `supports_cuda_graphs` (its launch must depend on
the batch only through tensors and bind-time shapes). Prefill, prelude, coda and sampling stay
eager.
"""

from __future__ import annotations

import logging

import torch
from rlt_contracts import AttentionBackend, LoopedLanguageModel, PagedAttentionBatch

from rlt_runner.kv_storage import KVStorage
from rlt_runner.request_slots import RequestSlots

logger = logging.getLogger(__name__)


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two up to, and always including, `max_rows`."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


class DecodeGraphs:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        kv: KVStorage,
        slots: RequestSlots,
        *,
        max_rows: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv = kv
        self.slots = slots
        self.block_size = kv.block_size
        self.max_rows = max_rows
        self.replays = 0
        pages = slots.block_tables.shape[-1]
        hidden_size = slots.hidden.shape[-1]
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=slots.hidden.dtype, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.context = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.tables = torch.full(
            (max_rows, pages), kv.scratch_block, dtype=torch.int32, device=device
        )
        self.write_slots = torch.full((max_rows,), kv.scratch_slot, dtype=torch.long, device=device)
        self.query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        for rows in reversed(bucket_sizes(max_rows)):
            self._graphs[rows] = self._capture(rows, attention, pages)

    def _capture(self, rows: int, attention: AttentionBackend, pages: int):
        batch = PagedAttentionBatch(
            query_start=self.query_start[: rows + 1],
            context_lengths=self.context[:rows],
            block_tables=self.tables[:rows],
            write_slots=self.write_slots[:rows],
            max_query_len=1,
            max_context_len=pages * self.block_size,
        )
        bound = attention.bind(self.kv.tensors, batch)
        args = (self.hidden[:rows], self.positions[:rows], bound)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernel compilation and allocator state
            for _ in range(2):
                self.model.recurrent_step(*args, compute_gate=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden, exit_probs = self.model.recurrent_step(*args, compute_gate=True)
        return graph, hidden, exit_probs

    def run(
        self,
        hidden: torch.Tensor,
        slot_ids: torch.Tensor,
        planes: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop for R <= max_rows rows; returns views (valid until the next replay) of the
        new hidden state [R, d] and the exit probabilities [R] (fp32)."""
        rows = hidden.shape[0]
        size = min(s for s in self._graphs if s >= rows)
        graph, out_hidden, out_probs = self._graphs[size]
        self.hidden[:rows] = hidden
        self.positions[:rows] = positions
        self.context[:rows] = (positions + 1).to(torch.int32)
        tables = self.slots.block_tables[slot_ids, planes]
        self.tables[:rows] = tables
        blocks = tables.gather(1, (positions // self.block_size)[:, None]).squeeze(1).long()
        self.write_slots[:rows] = blocks * self.block_size + positions % self.block_size
        if rows < size:  # padding rows: scratch only
            self.hidden[rows:size] = 0
            self.positions[rows:size] = 0
            self.context[rows:size] = 1
            self.tables[rows:size] = self.kv.scratch_block
            self.write_slots[rows:size] = self.kv.scratch_slot
        graph.replay()
        self.replays += 1
        return out_hidden[:rows], out_probs[:rows]
