"""Self-speculative decoding on CUDA (skipped without a GPU).

- fp32 on CUDA (TF32 off), Triton attention and fused kernels, speculative rounds as CUDA
  graphs and eagerly, both layouts: tokens and exit depths equal the dense fp64 oracle, and
  drafts were really accepted;
- sampled and logprob rows, preemption and prefix caching run through the captured rounds
  (greedy rows still equal the oracle-exact plain engine);
- a whole speculative step makes no host-device sync besides the one read-back wait
  (torch.cuda.set_sync_debug_mode("error"));
- the benchmarks' forced acceptance accepts at the rate it is given (its graphs are captured
  separately) and is reachable only from Python;
- the KV pool is sized by a profile that includes a speculative round.
"""

from __future__ import annotations

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import SamplingParams
from test_async_pipeline import assert_same, scenario
from test_cuda_engine import PROMPTS, no_tf32, scenario_without_sync  # noqa: F401 (fixture)

pytestmark = pytest.mark.cuda

SPECULATIVE = dict(num_speculative_tokens=3, speculative_draft_loops=2)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_speculative_rounds_match_the_oracle(llm_factory, tiny_checkpoint, layout, graphs):
    llm = llm_factory(device="cuda", kv_layout=layout, cuda_graphs=graphs, **SPECULATIVE)
    runner = llm.engine.core.runner
    assert llm.engine.parts.attention_backend == "triton"
    assert (runner.speculative_graphs is not None) == graphs
    params = SamplingParams(max_tokens=10, exit_threshold=0.55, min_loops=1, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    oracle = GenerationOracle(DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), layout)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ref = oracle.generate(
            OracleRequest(tuple(prompt), 10, min_loops=1, threshold=0.55, ignore_eos=True)
        )
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (output.token_ids, output.exit_depths) == (ref.token_ids, ref.exit_depths)
    stats = llm.get_stats()
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0
    if graphs:
        assert runner.speculative_graphs.replays > 0


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_layout": "shared"},
        {
            "num_kv_blocks": 48,
            "incremental_kv": True,
            "enable_preemption": True,
            "enable_prefix_caching": True,
        },
    ],
    ids=["last_exited", "shared", "preemption+prefix_cache"],
)
def test_sampled_and_logprob_rows_through_captured_rounds(llm_factory, options):
    """The async-pipeline scenario (greedy, sampled and logprob rows, an abort and id reuse):
    greedy requests equal the plain CUDA engine's; sampled ones are well formed; no leak."""
    plain = scenario(llm_factory(device="cuda", **options))
    llm = llm_factory(device="cuda", **SPECULATIVE, **options)
    got = scenario(llm)
    greedy = {rid: o for rid, o in plain.items() if int(rid[1:]) % 2}
    assert_same({rid: got[rid] for rid in greedy}, greedy)
    for rid, out in got.items():
        assert len(out.token_ids) == len(plain[rid].token_ids)  # max_tokens, ignore_eos
    assert llm.get_stats().spec_drafts > 0


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_speculative_steps_make_no_host_sync_but_the_read_back(llm_factory, layout):
    llm = llm_factory(
        device="cuda",
        kv_layout=layout,
        num_kv_blocks=48 if layout == "last_exited" else 16,
        incremental_kv=True,
        enable_preemption=True,
        **SPECULATIVE,
    )
    stats = scenario_without_sync(llm)
    assert stats.spec_drafts > 0 and stats.generation_tokens > 0


def test_forced_acceptance_accepts_at_its_rate(llm_factory):
    llm = llm_factory(device="cuda", dtype="bfloat16", **SPECULATIVE)
    program = llm.engine.core.runner.speculation
    program.force_acceptance(0.9, seed=1)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    llm.generate(PROMPTS, params)
    stats = llm.get_stats()
    # per draft P(accepted | earlier accepted) = 0.9: the first position is accepted in ~90%
    # of rounds (a few hundred rounds: +-0.1 is > 4 standard deviations)
    first = stats.spec_accepted_per_position[0] / stats.spec_drafts
    assert first == pytest.approx(0.9, abs=0.1)
    program.force_acceptance(None)
    assert not program.forcing


def test_kv_pool_is_sized_with_a_speculative_round_profiled(llm_factory, tiny_checkpoint):
    from rlt import LLM

    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    options = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8)
    plain = LLM(path, **options)
    plan = plain.engine.parts.memory_plan
    plain.shutdown()
    llm = LLM(path, **options, **SPECULATIVE)
    spec_plan = llm.engine.parts.memory_plan
    assert spec_plan.source == "cuda_profile"
    assert spec_plan.activation.runner_bytes > plan.activation.runner_bytes  # draft buffers
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, seed=3))
    assert all(len(o.token_ids) >= 1 for o in out)
    llm.shutdown()
