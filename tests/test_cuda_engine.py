"""The engine on CUDA (skipped without a GPU): fp32 equals the dense oracle exactly as on the CPU
(TF32 off), and bf16 runs the same requests with the Triton backend and stays close to fp32."""

from __future__ import annotations

import pytest
import torch
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3],
    [7],
]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp32_cuda_matches_oracle(llm_factory, tiny_checkpoint, layout):
    llm = llm_factory(device="cuda", kv_layout=layout)
    assert llm.engine.parts.attention_backend == "triton"
    params = SamplingParams(max_tokens=8, exit_threshold=0.6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    oracle = GenerationOracle(DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), layout)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ref = oracle.generate(OracleRequest(tuple(prompt), 8, threshold=0.6, ignore_eos=True))
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (output.token_ids, output.exit_depths) == (ref.token_ids, ref.exit_depths)


def test_bf16_cuda_runs_and_tracks_fp32(llm_factory):
    params = SamplingParams(max_tokens=8, exit_threshold=0.6, ignore_eos=True, logprobs=0)
    bf16 = llm_factory(device="cuda", dtype="bfloat16").generate(PROMPTS, params)
    fp32 = llm_factory(device="cpu").generate(PROMPTS, params)
    # bf16 rounding may flip near-ties later in a sequence; the first token and its depth
    # (full-depth prefill) must agree, and its log-probability within bf16 precision
    for a, b in zip(bf16, fp32, strict=True):
        assert a.token_ids[0] == b.token_ids[0] and a.exit_depths[0] == b.exit_depths[0] == 4
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=5e-2)
        assert len(a.token_ids) == 8 and min(a.exit_depths[1:]) >= 2


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_cuda_graph_decode_equals_eager_and_oracle(llm_factory, tiny_checkpoint, layout):
    """Graph replays (padded buckets: 3 rows run in the 4-row graph) give the oracle's tokens."""
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=10, exit_threshold=0.6, ignore_eos=True)
    graphs = llm_factory(device="cuda", kv_layout=layout, cuda_graphs=True)
    eager = llm_factory(device="cuda", kv_layout=layout, cuda_graphs=False)
    assert graphs.engine.core.runner.graphs is not None and eager.engine.core.runner.graphs is None
    with_graphs = [(o.token_ids, o.exit_depths) for o in graphs.generate(prompts, params)]
    assert graphs.engine.core.runner.graphs.replays > 0
    assert with_graphs == [(o.token_ids, o.exit_depths) for o in eager.generate(prompts, params)]
    oracle = GenerationOracle(DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), layout)
    for prompt, got in zip(prompts, with_graphs, strict=True):
        ref = oracle.generate(OracleRequest(tuple(prompt), 10, threshold=0.6, ignore_eos=True))
        assert got == (ref.token_ids, ref.exit_depths)


def test_cuda_graphs_with_preemption_and_prefix_cache(llm_factory, tiny_checkpoint):
    """Under memory pressure (snapshots to host memory and back) with shared prompt pages, graph
    decoding still yields the oracle's greedy tokens and depths."""
    prompts = [PROMPTS[2] + [i + 1, i + 2] for i in range(5)]
    params = SamplingParams(max_tokens=12, exit_threshold=0.6, ignore_eos=True)
    tight = llm_factory(
        device="cuda",
        num_kv_blocks=64,
        incremental_kv=True,
        enable_preemption=True,
        enable_prefix_caching=True,
    )
    outputs = tight.generate(prompts, params)
    assert tight.get_stats().preemptions > 0 and tight.get_stats().prefix_cache_hit_tokens > 0
    oracle = GenerationOracle(
        DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), "last_exited"
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = oracle.generate(OracleRequest(tuple(prompt), 12, threshold=0.6, ignore_eos=True))
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
