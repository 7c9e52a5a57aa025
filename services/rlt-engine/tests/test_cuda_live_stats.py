"""Live engine statistics on CUDA (issue 41): the engine core's loop, writing a line after
every step, makes no host-device sync besides each step's own read-back wait
(torch.cuda.set_sync_debug_mode("error"), as tests/test_cuda_engine.py checks whole steps),
and its lines carry the throughput and loop mix. Skipped without CUDA."""

from __future__ import annotations

import logging

import pytest
import torch
from rlt.engine import EngineConfig, LLMEngine
from rlt.engine.core_loop import CoreLoop
from rlt_contracts import CoreAdd, EngineRequest, SamplingParams

pytestmark = pytest.mark.cuda

STATS_LOGGER = "rlt.engine.stats"


def test_a_line_after_every_step_adds_no_host_sync_to_the_cuda_loop(tiny_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    config = EngineConfig.from_options(
        model=path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8
    )
    engine = LLMEngine(config)
    loop = CoreLoop(engine.core, stats_interval_s=1e-9)  # every step finds its line due
    params = SamplingParams(max_tokens=24, exit_threshold=0.5, min_loops=1, ignore_eos=True)

    def burst(call_id: int) -> None:
        requests = tuple(
            EngineRequest(f"r{call_id}-{i}", (5, 17, 200, 3, 99 + i), params) for i in range(4)
        )
        loop.handle("fe", CoreAdd(call_id, requests))
        while loop.has_work:
            loop.step()
            loop.take_outputs()  # the round's outputs read the statistics too
        loop.step()  # an idle round: the ended window's line

    try:
        burst(1)  # first use: graph replays, allocations, kernel choices
        torch.cuda.synchronize()
        caplog.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            burst(2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert len(lines) >= 3, lines
    assert any("exited early" in line for line in lines), lines
    assert "0 running" in lines[-1]
