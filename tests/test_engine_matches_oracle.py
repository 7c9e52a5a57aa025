"""Greedy engine output (tokens AND exit depths) equals the token-by-token dense oracle.

Covered: the KV layouts (ring:2 of 4 loops: loops 1, 3 and 2, 4 share a plane; its prompts run
whole), both scheduling modes, fixed depth (threshold 1.0) and adaptive exit (thresholds below
1, so early exits really happen), many concurrent requests of different lengths with chunked
prefill and queueing (max_num_seqs < number of requests). A ring's fill of the planes an early
exit never wrote: tests/test_ring_kv_layout.py.

Conditioning: the engine runs fp32, the oracle fp64. Each decision's distance to flipping is
reported by the oracle (gate CDF vs threshold, top-2 logit gap); the test requires it to exceed
1e-4, far above fp32 rounding (~1e-6 relative), so agreement is expected and not luck.
"""

from __future__ import annotations

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import SamplingParams

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3, 8, 19],
    [7],
    [100, 101, 102, 103, 104],
    [13, 260, 33, 47, 58, 69, 71, 82, 90, 91, 92, 93, 94, 95, 96, 97, 98],
]
MAX_TOKENS = [9, 6, 7, 10, 5, 8]
MARGIN = 1e-4


def oracle_outputs(path, layout: str, threshold: float, min_loops: int = 2):
    oracle = GenerationOracle(DenseOuro(path), layout)
    results = [
        oracle.generate(
            OracleRequest(tuple(p), n, min_loops=min_loops, threshold=threshold, ignore_eos=True)
        )
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    for r in results:
        assert r.min_logit_margin > MARGIN and r.min_gate_margin > MARGIN, "ill-conditioned case"
    return results


@pytest.mark.parametrize("layout", ["last_exited", "shared", "ring:2"])
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
@pytest.mark.parametrize("threshold", [1.0, 0.8, 0.55])
def test_greedy_tokens_and_exit_depths_match_oracle(
    llm_factory, tiny_checkpoint, layout, mode, threshold
):
    llm = llm_factory(kv_layout=layout, scheduling_mode=mode)
    params = [
        SamplingParams(max_tokens=n, exit_threshold=threshold, ignore_eos=True) for n in MAX_TOKENS
    ]
    outputs = llm.generate(PROMPTS, params)
    expected = oracle_outputs(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3), layout, threshold)
    for output, reference in zip(outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.exit_depths == reference.exit_depths
        assert output.finish_reason == "length"
    depths = [d for o in outputs for d in o.exit_depths[1:]]
    if threshold == 1.0:
        assert set(depths) == {4}
    else:
        assert min(depths) < 4, "adaptive exit never fired: the test would not cover early exit"
    assert all(o.exit_depths[0] == 4 for o in outputs)


def test_min_and_max_loops_bound_exit_depths(llm_factory):
    llm = llm_factory()
    out = llm.generate(
        PROMPTS[:3], SamplingParams(max_tokens=8, exit_threshold=0.0, min_loops=3, ignore_eos=True)
    )
    assert {d for o in out for d in o.exit_depths[1:]} == {3}
    out = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, max_loops=2, ignore_eos=True))
    assert {d for o in out for d in o.exit_depths[1:]} == {2}
