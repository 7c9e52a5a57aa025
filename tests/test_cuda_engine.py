"""The engine on CUDA (skipped without a GPU): fp32 equals the dense oracle exactly as on the CPU
(TF32 off), and bf16 runs the same requests with the Triton backend and stays close to fp32."""

from __future__ import annotations

import pytest
import torch
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3], [7]]


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
