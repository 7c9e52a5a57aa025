"""CUDA graphs of the decode tick: one per (padded row count, sampling mode, gate needed).

A tick is ~10 kernels per layer plus the exit rule, finalization copies, LM head, sampler and
commit (over 300 launches at 24 layers); as a graph it is one launch. Every input and output
lives in persistent buffers read and written in place, so the host queues K replays and moves
on. Buckets (powers of two up to `max_rows`; a tick over rows [0, B) runs the smallest bucket
>= B), what is captured when, and how a capture leaves every request's state and the step's
records intact are README.md's "CUDA graphs". All graphs share one memory pool: only one
replays at a time.
"""

from __future__ import annotations

import logging

import torch
from rlt_contracts import SamplingMode

from rlt_runner.decode_program import DecodeProgram
from rlt_runner.graph_capture import capture

logger = logging.getLogger(__name__)


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two up to, and always including, `max_rows`."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


class DecodeGraphs:
    def __init__(self, program: DecodeProgram, *, max_rows: int) -> None:
        self.program = program
        self.buckets = bucket_sizes(max_rows)
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, SamplingMode, bool], torch.cuda.CUDAGraph] = {}
        keys = [(rows, gate) for rows in reversed(self.buckets) for gate in (False, True)]
        for done, (rows, gate) in enumerate(keys, 1):  # start-up progress, one line each
            self._capture(rows, SamplingMode(), gate)
            logger.info(
                "CUDA graphs: decode tick %d/%d (%d rows, gate %s)", done, len(keys), rows, gate
            )

    @property
    def captured(self) -> int:
        return len(self._graphs)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_rows: int) -> int:
        return next(size for size in self.buckets if size >= num_rows)

    def tick(self, num_rows: int, mode: SamplingMode, gate: bool) -> None:
        """Queue one tick over rows [0, num_rows) (padded to its bucket)."""
        key = (self.bucket(num_rows), mode, gate)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(*key)
        graph.replay()
        self.replays += 1

    def _capture(self, rows: int, mode: SamplingMode, gate: bool) -> torch.cuda.CUDAGraph:
        program, state = self.program, self.program.rows
        saved = state.active.clone(), state.parked.clone(), program.tick_index.clone()
        state.active.zero_()
        # the warm-ups record in the ring's spare rows: a capture in the middle of a step (a
        # new sampling mode) must not overwrite its earlier ticks' records or run past the ring
        program.tick_index.fill_(program.spare_tick)
        graph = capture(lambda: program.tick(rows, mode, gate), self.pool)
        state.active.copy_(saved[0])
        state.parked.copy_(saved[1])
        program.tick_index.copy_(saved[2])
        self._graphs[(rows, mode, gate)] = graph
        logger.debug("captured the decode tick for %d rows, %s, gate %s", rows, mode, gate)
        return graph
