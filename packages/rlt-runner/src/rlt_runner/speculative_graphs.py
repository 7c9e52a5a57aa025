"""CUDA graphs of speculative rounds: one per (slot bucket, sampling mode, gate needed).

A round is (K + 1) x D draft loops, the verify loops and the accept/commit bookkeeping, several
thousand kernels at 24 layers; as a graph it is one launch, over the program's persistent
buffers and the rows' state, read and written in place. Buckets, captures and the shared pool
are as for decode ticks (decode_graphs.py; README.md, "Speculative rounds"); the benchmarks'
forced acceptance is captured on first use.
"""

from __future__ import annotations

import logging

import torch
from rlt_contracts import SamplingMode

from rlt_runner.decode_graphs import bucket_sizes
from rlt_runner.graph_capture import capture
from rlt_runner.speculative_program import SpeculativeProgram

logger = logging.getLogger(__name__)


class SpeculativeGraphs:
    def __init__(self, program: SpeculativeProgram, *, pool) -> None:
        self.program = program
        self.buckets = bucket_sizes(program.max_slots)
        self.pool = pool
        self.replays = 0
        self._graphs: dict[tuple[int, SamplingMode, bool, bool], torch.cuda.CUDAGraph] = {}
        for slots in reversed(self.buckets):
            for gate in (False, True):
                self._capture(slots, SamplingMode(), gate)

    def capture_buckets(self, mode: SamplingMode, gate: bool) -> None:
        """Capture the (mode, gate) round of every bucket not captured yet, under the program's
        current forcing (so a later replay never captures in the middle of a step)."""
        for slots in reversed(self.buckets):
            if (slots, mode, gate, self.program.forcing) not in self._graphs:
                self._capture(slots, mode, gate)

    def bucket(self, num_slots: int) -> int:
        return next(size for size in self.buckets if size >= num_slots)

    def round(self, num_slots: int, mode: SamplingMode, gate: bool) -> None:
        """Queue one round over slots [0, num_slots) (a bucket size)."""
        key = (num_slots, mode, gate, self.program.forcing)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(num_slots, mode, gate)
        graph.replay()
        self.replays += 1

    def _capture(self, slots: int, mode: SamplingMode, gate: bool) -> torch.cuda.CUDAGraph:
        program = self.program
        saved = program.slot_valid.clone(), program.round_index.clone()
        program.slot_valid.zero_()
        program.round_index.fill_(program.spare_round)
        graph = capture(lambda: program.round(slots, mode, gate), self.pool)
        program.slot_valid.copy_(saved[0])
        program.round_index.copy_(saved[1])
        self._graphs[(slots, mode, gate, program.forcing)] = graph
        logger.debug("captured a speculative round: %d slots, %s, gate %s", slots, mode, gate)
        return graph
