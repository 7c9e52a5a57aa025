"""The engine on CUDA (skipped without a GPU).

- fp32 on CUDA (TF32 off) equals the dense fp64 oracle token- and depth-exactly, with the fused
  kernels and graphs (decode ticks, prefill steps, SHARED prefill waves) on and with all off,
  in both layouts;
- bf16 stays close to fp32 (first token, its depth and logprob);
- programmatic dependent launch changes no token, depth or logprob (fp32 and bf16), and
  neither does skipping the LM head in ticks where no row exits;
- graphs under preemption and prefix caching still give the oracle's tokens;
- the asynchronous multi-tick pipeline equals synchronous single ticks, with an abort and
  id reuse, under preemption and with prefix caching;
- whole engine steps (prefill, decode ticks with early exits and LAST_EXITED finalization,
  coda, sampling, preemption snapshots and restores) make no host-device sync besides the one
  read-back wait per step (torch.cuda.set_sync_debug_mode("error"));
- two engines built one after the other in one process get the same KV pool, and shutdown
  returns the device memory.
"""

from __future__ import annotations

import gc

import pytest
import torch
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import LLM, SamplingParams
from test_async_pipeline import assert_same, scenario

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


def oracle_for(tiny_checkpoint, layout: str) -> GenerationOracle:
    return GenerationOracle(DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), layout)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("fast", [True, False], ids=["fused+graphs", "eager"])
def test_fp32_cuda_matches_oracle(llm_factory, tiny_checkpoint, layout, fast):
    llm = llm_factory(device="cuda", kv_layout=layout, cuda_graphs=fast, fused_kernels=fast)
    assert llm.engine.parts.attention_backend == "triton"
    runner = llm.engine.core.runner
    assert (runner.graphs is not None) == fast
    assert llm.engine.parts.model.fused_impl(runner.rows.hidden) == ("triton" if fast else None)
    params = SamplingParams(max_tokens=10, exit_threshold=0.6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    oracle = oracle_for(tiny_checkpoint, layout)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ref = oracle.generate(OracleRequest(tuple(prompt), 10, threshold=0.6, ignore_eos=True))
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (output.token_ids, output.exit_depths) == (ref.token_ids, ref.exit_depths)
    assert min(d for o in outputs for d in o.exit_depths[1:]) < 4  # early exits happened
    if fast:
        assert runner.graphs.replays > 0
        if layout == "shared":  # the prompts ran as wave graphs (rlt_runner.shared_prefill)
            assert runner.shared_waves.replays >= max(len(p) for p in PROMPTS)
        else:  # and as depth-major step graphs (rlt_runner.prefill_graphs)
            assert runner.prefill_graphs.replays > 0


def test_bf16_cuda_runs_and_tracks_fp32(llm_factory):
    """bf16 rounding may flip near-ties later in a sequence; the first token and its depth
    (full-depth prefill) must agree, and its log-probability within bf16 precision (~1e-2
    relative on logits of magnitude ~1 here, 5e-2 absolute on the logprob)."""
    params = SamplingParams(max_tokens=8, exit_threshold=0.6, ignore_eos=True, logprobs=0)
    bf16 = llm_factory(device="cuda", dtype="bfloat16").generate(PROMPTS, params)
    fp32 = llm_factory(device="cpu").generate(PROMPTS, params)
    for a, b in zip(bf16, fp32, strict=True):
        assert a.token_ids[0] == b.token_ids[0] and a.exit_depths[0] == b.exit_depths[0] == 4
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=5e-2)
        assert len(a.token_ids) == 8 and min(a.exit_depths[1:]) >= 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_programmatic_dependent_launch_changes_no_result(llm_factory, dtype):
    """PDL (on by default on sm_90+) only lets a kernel start while its predecessor drains:
    tokens, exit depths and logprobs are bit-identical with it off (same kernels, same math;
    the second engine reuses the first's small-batch GEMV choices). One switch turns it off
    for both kernel packages."""
    from rlt_contracts import dependent_launch

    params = SamplingParams(max_tokens=10, exit_threshold=0.6, ignore_eos=True, logprobs=2)
    results = {}
    try:
        for enabled in (False, True):
            dependent_launch.set_enabled(enabled)
            outputs = llm_factory(device="cuda", dtype=dtype).generate(PROMPTS, params)
            results[enabled] = [(o.token_ids, o.exit_depths, o.logprobs) for o in outputs]
    finally:
        dependent_launch.set_enabled(None)
    assert results[True] == results[False]


def test_skipped_coda_changes_no_result(llm_factory, monkeypatch):
    """With the Triton tick kernels the LM head is told whether any row exits and, as a Triton
    GEMV (forced here for every projection and the head), skips its work in ticks where none
    does. bf16 tokens, depths and logprobs equal the torch tick's, which always runs the head
    (same model kernels, so bit-identical), eagerly and in decode graphs."""
    from rlt_models import small_batch_linear as sbl

    monkeypatch.setattr(sbl.small_batch_linear, "choices", {})
    monkeypatch.setattr(
        sbl.SmallBatchLinear,
        "_measure",
        staticmethod(lambda rows, weight: sbl.CONFIGS[9] if rows == 1 else sbl.CONFIGS[0]),
    )
    params = [
        SamplingParams(max_tokens=9, exit_threshold=0.6, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=7, exit_threshold=1.0, ignore_eos=True),
    ]
    results = []
    for fused_tick, graphs in ((False, False), (True, False), (True, True)):
        llm = llm_factory(device="cuda", dtype="bfloat16", max_num_seqs=2, cuda_graphs=graphs)
        program = llm.engine.core.runner.program
        assert program.kernels is not None  # the engine's default on CUDA
        if not fused_tick:
            program.kernels = None
        outputs = llm.generate(PROMPTS[:2], params)
        results.append([(o.token_ids, o.exit_depths, o.logprobs) for o in outputs])
    assert results[0] == results[1] == results[2]
    assert set(sbl.small_batch_linear.choices.values()) <= {sbl.CONFIGS[9], sbl.CONFIGS[0]}


def test_cuda_graphs_with_preemption_and_prefix_cache(llm_factory, tiny_checkpoint):
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
    oracle = oracle_for(tiny_checkpoint, "last_exited")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = oracle.generate(OracleRequest(tuple(prompt), 12, threshold=0.6, ignore_eos=True))
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"scheduling_mode": "no_refill"},
        {"kv_layout": "shared"},
        {"enable_prefix_caching": True},
    ],
    ids=["last_exited", "no_refill", "shared", "prefix_cache"],
)
def test_cuda_async_pipeline_equals_synchronous_ticks(llm_factory, options):
    """The scenario aborts a request and reuses its id; the pipelined engine runs it with
    plenty of KV, then with too little (40 blocks: the refilled LAST_EXITED engines preempt)."""
    tight = dict(num_kv_blocks=40, incremental_kv=True, enable_preemption=True)
    reference = scenario(
        llm_factory(device="cuda", async_scheduling=False, decode_ticks_per_step=1, **options)
    )
    roomy = llm_factory(device="cuda", **options)
    assert_same(scenario(roomy), reference)
    squeezed = llm_factory(device="cuda", **tight, **options)
    assert_same(scenario(squeezed), reference)
    if options.get("enable_prefix_caching"):
        assert roomy.get_stats().prefix_cache_hit_tokens > 0
    if options.keys() <= {"enable_prefix_caching"}:
        assert squeezed.get_stats().preemptions > 0


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_engine_steps_make_no_host_sync_but_the_read_back(llm_factory, layout):
    """Warm up (kernel compilation and graph capture of every sampling mode used), then run
    the same traffic with CUDA's sync debug mode set to raise on any synchronizing call
    (SHARED: its prompts run as wave graphs; prefix caching is LAST_EXITED only)."""
    llm = llm_factory(
        device="cuda",
        kv_layout=layout,
        num_kv_blocks=40 if layout == "last_exited" else 16,  # one plane: 16 still preempts
        incremental_kv=True,
        enable_preemption=True,
        enable_prefix_caching=layout == "last_exited",
    )
    stats = scenario_without_sync(llm)
    assert stats.preemptions > 0 and stats.generation_tokens > 0


def scenario_without_sync(llm):
    """Warm up with the async-pipeline scenario (compilation, graphs of every mode used), then
    run it again with any synchronizing CUDA call raising; returns the engine's stats."""
    scenario(llm)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scenario(llm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return llm.get_stats()


def test_two_engines_one_after_the_other_get_the_same_pool(tiny_checkpoint):
    """KV sizing profiles activations and counts memory torch caches but does not use as free,
    so a second engine is sized like the first; shutdown returns the device memory. The
    engine's share (gpu_memory_utilization, per instance) is set ~384 MiB above what this
    process's tensors use (the activation reserve is rounded up to 128 MiB), so the pool is
    sized by memory, not capped by what max_num_seqs full-length requests could use (512 MiB
    here). A first engine leaves the process's own state: a cuBLAS workspace (32 MiB on
    Hopper) for each stream that ran a matmul (the default one, the graphs' warm-up and capture
    streams), kept by torch for the process's life; later engines add none (graph captures
    warm up on one stream, not a new one each: 29 x 32 MiB stayed after one engine before)."""
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()

    def engine_options() -> dict:
        share = (torch.cuda.memory_allocated() + (384 << 20)) / total
        return dict(
            device="cuda",
            dtype="float32",
            max_model_len=512,
            max_num_seqs=512,
            max_num_batched_tokens=1024,
            gpu_memory_utilization=share,
        )

    with LLM(path, **engine_options()) as warm:  # the process's one-time state
        warm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    options = engine_options()
    before = torch.cuda.memory_allocated()
    first = LLM(path, **options)
    plan = first.engine.parts.memory_plan
    assert plan.source == "cuda_profile" and plan.num_blocks < plan.useful_blocks
    assert plan.activation.prefill_bytes > 0 and plan.activation.decode_bytes > 0
    first.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    first.shutdown()
    after_one = torch.cuda.memory_allocated()
    assert after_one - before < 32 << 20  # nothing of the engine remains
    with LLM(path, **options) as second:
        assert second.engine.parts.memory_plan.num_blocks == plan.num_blocks
    assert torch.cuda.memory_allocated() == after_one
    third = LLM(path, **options)  # the next one is left to garbage collection alone
    assert third.engine.parts.memory_plan.num_blocks == plan.num_blocks
    del third
    gc.collect()
    fourth = LLM(path, **options)
    assert fourth.engine.parts.memory_plan.num_blocks == plan.num_blocks
    fourth.shutdown()
