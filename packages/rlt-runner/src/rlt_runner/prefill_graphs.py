"""Depth-major prefill steps as CUDA graphs (LAST_EXITED).

Eagerly, a prefill step launches every kernel of every layer of every loop from the host: at
Ouro-1.4B, two 1,024-token chunks take ~50 ms of host launch time for ~40 ms of GPU time (H200,
`benchmarks/prefill_host_cost.py` at 9d2bf4f), so prefill steps were bound by the host. Here a
step is one graph replay.

Graphs are keyed by (token bucket, group bucket): the step's packed prompt tokens padded to a
power of two (at least MIN_TOKENS, at most `max_tokens`), its chunks padded to a power of two
(at most `max_groups`); one chunk's graphs are captured at engine start, for every token
bucket, the others on first use (a capture synchronizes the device once), all into the decode
graphs' memory pool (one graph replays at a time; every output is copied to a persistent
buffer). Inputs live in persistent buffers, written by one upload per step:

    tokens [4, T] int64   token id, position, group, valid (padding: valid 0)
    groups [3, G] int64   row, context end, packed query end (padding: query length 0)

Padding tokens write their keys and values to the scratch slot and their rows are never kept;
padding groups have no queries, so the attention kernel returns at once for them. The attention
grid is sized for the group bucket and `min(T, max_query_len)` queries per group; a query tile
is computed the same way whatever the grid, so a graph's attention equals the eager call's.

Worked example (max_tokens 2048, chunks of 1,000 and 24 positions): 1,024 tokens -> bucket
1,024, 2 groups -> bucket 2; tokens [4, 1024] all valid; groups [[r0, r1], [1000, e1],
[1000, 1024]]; one replay, then each completing chunk's last state is copied to its row.
"""

from __future__ import annotations

import logging
import time
from itertools import accumulate

import torch
from rlt_contracts import AttentionBackend, KVLayoutSpec, LoopedLanguageModel, PagedAttentionBatch

from rlt_runner.graph_capture import capture
from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_state import DecodeRows
from rlt_runner.transfers import upload

logger = logging.getLogger(__name__)

MIN_TOKENS = 16


def _bucket(count: int, limit: int, smallest: int = 1) -> int:
    """The smallest power of two >= count (and >= smallest), capped at limit."""
    size = smallest
    while size < count:
        size *= 2
    return min(size, limit)


class PrefillGraphs:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        kv: KVStorage,
        rows: DecodeRows,
        layout: KVLayoutSpec,
        *,
        max_tokens: int,
        max_groups: int,
        max_query_len: int,
        pool,
    ) -> None:
        self.model, self.attention, self.layout = model, attention, layout
        self.kv, self.rows = kv, rows
        self.max_tokens, self.max_groups = max_tokens, max_groups
        self.max_query_len = max_query_len
        self.pool = pool
        device = rows.device
        self.tokens = torch.zeros(4, max_tokens, dtype=torch.int64, device=device)
        self.groups = torch.zeros(3, max_groups, dtype=torch.int64, device=device)
        self.hidden = rows.hidden.new_zeros(max_tokens, rows.hidden.shape[1])
        self.replays = 0
        self.capture_s = 0.0  # host seconds spent capturing (warm-ups and recording included)
        self.disabled_reason = ""  # set if a capture failed: every later step runs eagerly
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @staticmethod
    def buffer_bytes(max_tokens: int, max_groups: int, hidden_size: int, dtype) -> int:
        """Device bytes of the persistent buffers such an instance allocates (inputs, output)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (4 * max_tokens + 3 * max_groups) * 8 + max_tokens * hidden_size * itemsize

    @property
    def captured(self) -> int:
        """Graphs captured so far (one per token x chunk-count bucket used)."""
        return len(self._graphs)

    def run(self, chunks: list[tuple[int, int, tuple[int, ...], bool]]) -> bool:
        """Chunks (row, start_position, token_ids, completes_prompt) at full depth, depth-major
        (prefill.py); a chunk that completes its prompt leaves its last state in its row.
        False, with nothing done: they do not fit the buffers or the attention grid, or
        graphs are disabled; the caller runs them eagerly."""
        num_tokens = sum(len(tokens) for _, _, tokens, _ in chunks)
        if (
            self.disabled_reason
            or len(chunks) > self.max_groups
            or num_tokens > self.max_tokens
            or max(len(tokens) for _, _, tokens, _ in chunks) > self.max_query_len
        ):
            return False
        width = _bucket(num_tokens, self.max_tokens, MIN_TOKENS)
        groups = _bucket(len(chunks), self.max_groups)
        pad = width - num_tokens
        token_ids = [t for _, _, tokens, _ in chunks for t in tokens]
        positions = [s + i for _, s, tokens, _ in chunks for i in range(len(tokens))]
        group_of = [g for g, (_, _, tokens, _) in enumerate(chunks) for _ in tokens]
        ends = [start + len(tokens) for _, start, tokens, _ in chunks]
        query_end = list(accumulate(len(tokens) for _, _, tokens, _ in chunks))
        gpad = groups - len(chunks)
        kept = [(g, row) for g, (row, _, _, done) in enumerate(chunks) if done]
        host = [
            token_ids + [0] * pad,
            positions + [0] * pad,
            group_of + [0] * pad,
            [1] * num_tokens + [0] * pad,
            [row for row, _, _, _ in chunks] + [0] * gpad,
            ends + [0] * gpad,
            query_end + [num_tokens] * gpad,
            [row for _, row in kept] + [query_end[g] - 1 for g, _ in kept],
        ]
        flat = [v for column in host for v in column]
        graph = self._graph(width, groups)
        if graph is None:
            return False
        values = upload(flat, torch.int64, self.rows.device)
        self.tokens[:, :width].copy_(values[: 4 * width].view(4, width))
        self.groups[:, :groups].copy_(values[4 * width : 4 * width + 3 * groups].view(3, groups))
        graph.replay()
        self.replays += 1
        if kept:
            keep = values[4 * width + 3 * groups :].view(2, len(kept))
            self.rows.hidden.index_copy_(0, keep[0], self.hidden.index_select(0, keep[1]))
        return True

    def capture_token_buckets(self) -> None:
        """Capture every token bucket for one chunk now (engine start). A first capture at a
        new query-length class compiles Triton specializations: ~0.7 s each on an H200, a
        stall of every running request if it happened while serving; later captures of
        another chunk count reuse them (~0.1-0.17 s each, `benchmarks/prefill_capture_cost.py` at
        9d2bf4f)."""
        width = MIN_TOKENS
        while self._graph(min(width, self.max_tokens), 1) is not None:
            logger.info("CUDA graphs: prefill step of %d tokens", min(width, self.max_tokens))
            if width >= self.max_tokens:
                break
            width *= 2

    def _graph(self, width: int, groups: int) -> torch.cuda.CUDAGraph | None:
        """The bucket's graph, captured now if it is new; None if graphs are disabled (a
        capture failed, e.g. out of memory: keep serving, eagerly)."""
        graph = self._graphs.get((width, groups))
        if graph is None and not self.disabled_reason:
            started = time.perf_counter()
            try:
                graph = self._graphs[(width, groups)] = self._capture(width, groups)
            except RuntimeError as exc:
                logger.warning("prefill graph capture failed, prefilling eagerly: %s", exc)
                self.disabled_reason = f"capture failed: {exc}"
            finally:
                self.capture_s += time.perf_counter() - started
        return graph

    def _program(self, width: int, groups: int) -> None:
        """The recorded step: embed, then every loop at its plane over the inputs' buckets."""
        rows, bs = self.rows, self.kv.block_size
        token, position, group, valid = self.tokens[:, :width].unbind(0)
        row, ends, query_end = self.groups[:, :groups].unbind(0)
        query_start = torch.cat([query_end.new_zeros(1), query_end]).to(torch.int32)
        context = ends.to(torch.int32)
        valid = valid.bool()
        page, offset = position // bs, position % bs
        hidden = self.model.embed(token)
        for loop in range(1, self.model.shape.num_loops + 1):
            tables = rows.block_tables[row, self.layout.plane_of_loop(loop)]
            slot = tables[group, page].to(torch.int64) * bs + offset
            batch = PagedAttentionBatch(
                query_start=query_start,
                context_lengths=context,
                block_tables=tables,
                write_slots=torch.where(valid, slot, self.kv.scratch_slot),
                max_query_len=min(width, self.max_query_len),
                max_context_len=tables.shape[1] * bs,
            )
            bound = self.attention.bind(self.kv.tensors, batch)
            hidden, _ = self.model.recurrent_step(hidden, position, bound, compute_gate=False)
        self.hidden[:width].copy_(hidden)

    def _capture(self, width: int, groups: int) -> torch.cuda.CUDAGraph:
        self.tokens.zero_()  # no valid token: the warm-ups write only the scratch slot
        self.groups.zero_()
        graph = capture(lambda: self._program(width, groups), self.pool)
        logger.debug("captured prefill for %d tokens, %d groups", width, groups)
        return graph
