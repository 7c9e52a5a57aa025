"""Prefill as CUDA graphs record it, on the CPU: the programs of the SHARED layout's waves
(rlt_runner.shared_prefill) and of depth-major steps (rlt_runner.prefill_graphs), run directly
in place of a replay, give the dense oracle's tokens and exit depths with chunked prompts of
different lengths (waves of changing width, prompts that complete in the middle of a step's
waves; steps padded to token and chunk-count buckets). On CUDA the graphs themselves are
checked against the oracle by tests/test_cuda_engine.py."""

from __future__ import annotations

import pytest
from rlt import SamplingParams
from rlt_runner.decode_graphs import bucket_sizes
from rlt_runner.prefill_graphs import PrefillGraphs
from rlt_runner.shared_prefill import SharedPrefillGraphs
from test_engine_matches_oracle import MAX_TOKENS, PROMPTS, oracle_outputs


class _DirectReplay:
    """Stands in for a captured graph: a replay runs the recorded wave program."""

    def __init__(self, waves: SharedPrefillGraphs, width: int) -> None:
        self.waves, self.width, self.replays = waves, width, 0

    def replay(self) -> None:
        self.replays += 1
        self.waves._wave(self.width)


class _DirectStep:
    """The same for a depth-major prefill step of `tokens` x `groups` buckets."""

    def __init__(self, graphs: PrefillGraphs, tokens: int, groups: int) -> None:
        self.graphs, self.key = graphs, (tokens, groups)

    def replay(self) -> None:
        self.graphs._program(*self.key)


def prefill_graphs_of(runner) -> PrefillGraphs:
    """Prefill graphs for a runner of `llm_factory(max_num_batched_tokens=24)` (chunks of 5)."""
    return PrefillGraphs(
        runner.model,
        runner.attention,
        runner.kv,
        runner.rows,
        runner.layout,
        max_tokens=24,
        max_groups=runner.rows.hidden.shape[0],
        max_query_len=5,
        pool=None,
    )


def assert_matches_oracle(llm, tiny_checkpoint, layout: str, threshold: float) -> None:
    """Greedy tokens and exit depths of PROMPTS equal the dense oracle's."""
    params = [
        SamplingParams(max_tokens=n, exit_threshold=threshold, ignore_eos=True) for n in MAX_TOKENS
    ]
    outputs = llm.generate(PROMPTS, params)
    expected = oracle_outputs(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3), layout, threshold)
    for output, reference in zip(outputs, expected, strict=True):
        assert (output.token_ids, output.exit_depths) == (
            reference.token_ids,
            reference.exit_depths,
        )


@pytest.mark.parametrize("threshold", [1.0, 0.55])
def test_wave_program_matches_the_oracle(llm_factory, tiny_checkpoint, monkeypatch, threshold):
    monkeypatch.setattr(SharedPrefillGraphs, "_capture", lambda self, w: _DirectReplay(self, w))
    llm = llm_factory(kv_layout="shared", max_num_batched_tokens=24)
    runner = llm.engine.core.runner
    runner.shared_waves = SharedPrefillGraphs(
        runner.model,
        runner.attention,
        runner.kv,
        runner.rows,
        buckets=bucket_sizes(runner.rows.hidden.shape[0]),
        pool=None,
    )
    assert_matches_oracle(llm, tiny_checkpoint, "shared", threshold)
    waves = runner.shared_waves
    assert waves.replays >= max(len(p) for p in PROMPTS)  # one replay per prompt position
    assert sum(1 for g in waves._graphs.values() if g.replays) >= 2  # several wave widths


@pytest.mark.parametrize("threshold", [1.0, 0.55])
def test_depth_major_prefill_program_matches_the_oracle(
    llm_factory, tiny_checkpoint, monkeypatch, threshold
):
    """LAST_EXITED prefill steps as rlt_runner.prefill_graphs records them (tokens and chunks
    padded to their buckets), run directly in place of a replay."""
    monkeypatch.setattr(PrefillGraphs, "_capture", lambda self, t, g: _DirectStep(self, t, g))
    llm = llm_factory(max_num_batched_tokens=24)
    runner = llm.engine.core.runner
    runner.prefill_graphs = graphs = prefill_graphs_of(runner)
    graphs.capture_token_buckets()  # as at engine start: one chunk, every token bucket
    assert list(graphs._graphs) == [(16, 1), (24, 1)]  # 24 tokens: the last bucket is capped
    assert_matches_oracle(llm, tiny_checkpoint, "last_exited", threshold)
    assert graphs.replays > 0 and len(graphs._graphs) > 2  # more chunk counts, on first use


def test_a_failed_prefill_capture_leaves_prefill_eager(llm_factory, tiny_checkpoint, monkeypatch):
    """A capture that fails (e.g. out of memory at engine start) disables the prefill graphs
    and nothing else: no later capture is tried, and every prompt still prefills, eagerly."""
    attempts = []

    def fail_second(self, tokens, groups):
        attempts.append((tokens, groups))
        if len(attempts) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return _DirectStep(self, tokens, groups)

    monkeypatch.setattr(PrefillGraphs, "_capture", fail_second)
    llm = llm_factory(max_num_batched_tokens=24)
    runner = llm.engine.core.runner
    runner.prefill_graphs = graphs = prefill_graphs_of(runner)
    graphs.capture_token_buckets()
    assert "out of memory" in graphs.disabled_reason and attempts == [(16, 1), (24, 1)]
    assert_matches_oracle(llm, tiny_checkpoint, "last_exited", 0.55)
    assert graphs.replays == 0 and len(attempts) == 2


def test_memory_profile_counts_the_prefill_graph_buffers(llm_factory):
    """The memory profile runs eagerly, so the runner counts the buffers its prefill graphs will
    hold (inputs and output sized for max_num_batched_tokens) in its persistent bytes."""
    runner = llm_factory(max_num_batched_tokens=24).engine.core.runner
    counted = runner.persistent_bytes()
    graphs = prefill_graphs_of(runner)
    allocated = sum(t.numel() * t.element_size() for t in (graphs.tokens, graphs.groups))
    allocated += graphs.hidden.numel() * graphs.hidden.element_size()
    runner._prefill_graph_limits = (0, 0)  # a runner that prefills eagerly holds none
    assert counted - runner.persistent_bytes() == allocated > 0
