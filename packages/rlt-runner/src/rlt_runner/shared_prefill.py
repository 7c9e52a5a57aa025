"""SHARED-layout prefill waves as CUDA graphs.

Under SHARED a prompt advances one position at a time through every loop (prefill.py). A wave
(one position of every prompt chunk in the step, all loops) is a decode-shaped call: one query
per row, written to plane 0. Eagerly it costs the host ~300 launches per loop and position;
as one graph replay a long SHARED prompt runs at the GPU's speed, not the host's.

One graph per wave width (the decode graphs' buckets: powers of two up to the row count), all
captured up front into the decode graphs' memory pool (one graph replays at a time). Its inputs
live in one persistent buffer `inputs` [4, S] int64 (rows: row, token id, position, valid),
written per wave by one device-to-device copy from the step's single upload of every wave;
padding columns are invalid: their key/value goes to the scratch slot and their state is never
kept. Attention sees the full table width, as the decode graphs do, so the split count of the
split-KV kernel is the same in every wave.

Worked example (2 prompt chunks of 3 and 2 positions starting at 0, rows 5 and 2): bucket 2,
waves [[5, 2], [t0, u0], [0, 0], [1, 1]], [[5, 2], [t1, u1], [1, 1], [1, 1]],
[[5, 0], [t2, 0], [2, 0], [1, 0]]: three replays, and after the second one row 2's chunk
keeps its final state (if it completes its prompt), after the third row 5's.
"""

from __future__ import annotations

import logging

import torch
from rlt_contracts import AttentionBackend, LoopedLanguageModel, PagedAttentionBatch

from rlt_runner.graph_capture import capture
from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_state import DecodeRows
from rlt_runner.transfers import upload

logger = logging.getLogger(__name__)


class SharedPrefillGraphs:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        kv: KVStorage,
        rows: DecodeRows,
        *,
        buckets: list[int],
        pool,
    ) -> None:
        self.model, self.attention, self.kv, self.rows = model, attention, kv, rows
        self.buckets = buckets
        self.pool = pool
        max_rows = buckets[-1]
        device = rows.device
        self.inputs = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        self.hidden = rows.hidden.new_zeros(max_rows, rows.hidden.shape[1])  # a wave's output
        self.query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.replays = 0
        self._graphs = {width: self._capture(width) for width in reversed(buckets)}

    def bucket(self, width: int) -> int:
        return next(size for size in self.buckets if size >= width)

    def run(self, chunks: list[tuple[int, int, tuple[int, ...], bool]]) -> None:
        """Chunks (row, start_position, token_ids, completes_prompt) position by position at
        full depth; a chunk that completes its prompt leaves its last state in its row."""
        width = self.bucket(len(chunks))
        num_waves = max(len(tokens) for _, _, tokens, _ in chunks)
        flat: list[int] = []
        keeps: dict[int, tuple[list[int], list[int]]] = {}  # wave -> (rows, columns) to keep
        for offset in range(num_waves):
            wave = [c for c in chunks if offset < len(c[2])]
            pad = [0] * (width - len(wave))
            flat += [r for r, _, _, _ in wave] + pad
            flat += [t[offset] for _, _, t, _ in wave] + pad
            flat += [s + offset for _, s, _, _ in wave] + pad
            flat += [1] * len(wave) + pad
            for column, (r, _, t, done) in enumerate(wave):
                if done and offset == len(t) - 1:
                    keeps.setdefault(offset, ([], []))[0].append(r)
                    keeps[offset][1].append(column)
        device = self.rows.device
        waves = upload(flat, torch.int64, device).view(num_waves, 4, width)
        keep_index = {o: upload(list(rc), torch.int64, device) for o, rc in keeps.items()}
        graph = self._graphs[width]
        for offset in range(num_waves):
            self.inputs[:, :width].copy_(waves[offset])
            graph.replay()
            self.replays += 1
            if offset in keep_index:  # chunks that completed their prompt in this wave
                target, column = keep_index[offset]
                self.rows.hidden.index_copy_(0, target, self.hidden.index_select(0, column))

    def _wave(self, width: int) -> None:
        """One wave over `inputs[:, :width]`: embed, then every loop at plane 0."""
        rows, bs = self.rows, self.kv.block_size
        row, token, position, valid = self.inputs[:, :width].unbind(0)
        valid = valid.bool()
        tables = rows.block_tables[row, 0]
        page = position // bs
        slot = tables.gather(1, page[:, None]).squeeze(1).to(torch.int64) * bs + position % bs
        batch = PagedAttentionBatch(
            query_start=self.query_start[: width + 1],
            context_lengths=torch.where(valid, position + 1, 1).to(torch.int32),
            block_tables=tables,
            write_slots=torch.where(valid, slot, self.kv.scratch_slot),
            max_query_len=1,
            max_context_len=tables.shape[1] * bs,
        )
        bound = self.attention.bind(self.kv.tensors, batch)
        hidden = self.model.embed(token)
        for _ in range(self.model.shape.num_loops):
            hidden, _ = self.model.recurrent_step(hidden, position, bound, compute_gate=False)
        self.hidden[:width].copy_(hidden)

    def _capture(self, width: int) -> torch.cuda.CUDAGraph:
        self.inputs.zero_()  # every column invalid: the warm-ups write only the scratch slot
        graph = capture(lambda: self._wave(width), self.pool)
        logger.debug("captured the SHARED prefill wave for %d rows", width)
        return graph
