"""Capturing a decode graph runs the tick eagerly first (graph_capture.WARMUP_RUNS times). A
capture can happen in the middle of a step (the first tick in a new sampling mode): its warm-up
ticks must record in the ring's spare rows, never over the records of the step's earlier ticks
and never past the ring (with one tick per step there was no row left: on CUDA an
out-of-bounds write next to the ring, seen as an intermittent illegal memory access)."""

from __future__ import annotations

import torch
from rlt_runner import decode_graphs
from rlt_runner.graph_capture import WARMUP_RUNS


def _eager_capture(run, pool):
    """Stands in for graph_capture.capture on the CPU: the warm-ups, no recording."""
    for _ in range(WARMUP_RUNS):
        run()
    return object()


def test_capture_warmups_record_only_in_the_spare_ring_rows(llm_factory, monkeypatch):
    monkeypatch.setattr(decode_graphs, "capture", _eager_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    llm = llm_factory(decode_ticks_per_step=2)
    program = llm.engine.core.runner.program
    assert program.ring.shape[0] == 2 + WARMUP_RUNS and program.spare_tick == 2
    program.ring.fill_(7.0)  # row 0: the record of the step's first tick, not yet read back
    program.tick_index.fill_(1)  # the second tick meets a mode without a graph
    decode_graphs.DecodeGraphs(program, max_rows=4)  # captures every bucket now
    assert bool((program.ring[:2] == 7.0).all())  # the step's rows: untouched
    assert bool((program.ring[2:, :, 0] == -1).all())  # the warm-ups' "no token" records
    assert program.tick_index.tolist() == [1]
