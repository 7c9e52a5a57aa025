"""Nanbeige4.2's and HRM-Text's engine features on CUDA (skipped without a GPU), on the CPU
tests' checkpoints (test_family_nanbeige.py, test_family_hrm_text.py).

- fp32 (TF32 off), decode CUDA graphs: self-speculative decoding (a one-loop draft, its rounds
  captured as graphs) and a PD pair joined by the loopback port give the reference's greedy
  tokens (Nanbeige: the dense float64 reference; HRM-Text: transformers' generate; every step's
  top-2 gap there exceeds 1e-4, far above fp32 rounding).
- bf16 with fp8 weights and an fp8 KV cache, graphs, a pool small enough to preempt: whole
  engine steps (prompts, decode ticks, preemption snapshots and restores, an abort and the id
  reused; prefix-cache hits for Nanbeige) make no host-device sync besides the one read-back
  per step (as tests/test_cuda_fp8.py for Ouro), and the pool holds one byte per element.

Run on one H100 at 0ddf472 (torch 2.11, triton 3.6): 4 passed in 92 s.
"""

from __future__ import annotations

import pytest
import torch
from family_feature_checks import pd_outputs
from rlt import LLM, SamplingParams
from rlt_models import write_random_checkpoint
from test_family_hrm_text import MAX_TOKENS as HRM_MAX_TOKENS
from test_family_hrm_text import PROMPTS as HRM_PROMPTS
from test_family_hrm_text import reference as hrm_reference
from test_family_hrm_text import write_hf_checkpoint
from test_family_nanbeige import CONFIG as NANBEIGE_CONFIG
from test_family_nanbeige import MAX_TOKENS, PROMPTS, reference_greedy

pytestmark = pytest.mark.cuda

ENGINE = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=["nanbeige", "hrm_text"])
def family(request, tmp_path_factory):
    """(checkpoint, prompts, max_tokens, the reference's greedy tokens, extra options)."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "nanbeige":
        path = write_random_checkpoint(out, NANBEIGE_CONFIG, seed=11)
        want = [reference_greedy(path, p, n, 2) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
        return path, PROMPTS, MAX_TOKENS, want, dict(enable_prefix_caching=True)
    path = write_hf_checkpoint(out)
    return path, HRM_PROMPTS, HRM_MAX_TOKENS, hrm_reference(path, prefix_lm=True), {}


@pytest.fixture
def make(family):
    made = []

    def build(**options):
        made.append(LLM(family[0], **{**ENGINE, **options}))
        return made[-1]

    yield build
    leaks = [llm.engine.core.leak_report() for llm in made]
    for llm in made:
        llm.shutdown()
    assert all(report == [] for report in leaks), leaks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_speculation_and_pd_on_cuda_give_the_reference_tokens(family, make):
    _, prompts, max_tokens, want, _ = family
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    speculative = make(num_speculative_tokens=3, speculative_draft_loops=1)
    assert speculative.engine.core.runner.speculative_graphs is not None
    assert [o.token_ids for o in speculative.generate(prompts, params)] == want
    assert speculative.get_stats().spec_accepted_tokens > 0
    outputs, _, (_, decode) = pd_outputs(make, prompts, params, nixl=False)
    assert [o.token_ids for o in outputs] == want
    assert decode.engine.core.runner.graphs is not None


def scenario(llm, prompts) -> dict:
    """Greedy and seeded requests; one aborted after a few steps, its id reused at once."""
    engine = llm.engine
    params = [
        SamplingParams(max_tokens=10 + i, ignore_eos=True, temperature=0.9 * (i % 2), seed=i)
        for i in range(len(prompts))
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i])
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.abort_request("r1")
    finals.pop("r1", None)
    engine.add_request("r1", prompts[0][:5] + [6], params[1])
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_engine_steps_make_no_host_sync_but_the_read_back(family, make):
    _, prompts, _, _, extra = family
    llm = make(
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype="fp8",
        block_size=4,
        num_kv_blocks=16,
        incremental_kv=True,
        enable_preemption=True,
        **extra,
    )
    runner = llm.engine.core.runner
    assert runner.graphs is not None and runner.kv.tensors.key_cache.element_size() == 1
    scenario(llm, prompts)  # warm-up: compilation, graphs of every mode used
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        finals = scenario(llm, prompts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(finals) == {f"r{i}" for i in range(len(prompts))}
    stats = llm.get_stats()
    assert stats.preemptions > 0 and stats.generation_tokens > 0
    assert llm.engine.model_info().weight_dtype == "float8_e4m3fn"
