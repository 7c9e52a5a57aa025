"""Nanbeige4.2 on CUDA (skipped without a GPU): the fused path (pre-norm layers through
`add_rms_norm` without a delta norm, the final norm after every loop fused into the last
layer's add) with decode and prefill CUDA graphs.

- fp32 on CUDA (TF32 off), fused + graphs, equals the dense float64 reference of
  tests/test_family_nanbeige.py token-exactly (its checkpoint and prompts: every greedy step's
  top-2 gap there exceeds 1e-4, far above fp32 rounding).
- bf16 on CUDA, fused (the default) and eager (`fused_kernels=False`), both with graphs, track
  fp32 on the CPU: greedy tokens are equal at every step whose fp32 top-2 logprob gap exceeds
  BF16_MARGIN, while the two sequences still share their context; the sampled tokens'
  logprobs agree within BF16_LOGPROB_TOL; fused and eager agree with each other the same way.

Tolerance argument (BF16_MARGIN): bf16 keeps 8 significant bits (unit roundoff 2^-9, about
0.002). The hidden state is rounded at every sublayer output, residual add and norm, 2
layers x 2 loops, then the LM head (fp32 accumulation) maps it to logits of magnitude about
0.2-1 here (weights of std 0.02, hidden 96). Each logit then carries an error of order
sqrt(number of roundings) x 0.002 x |logit| ~ 0.005, and bf16 on the CPU against fp32 on the
same checkpoint and prompts shows at most 0.0045 on the sampled tokens' logprobs (measured on
the development machine). A greedy choice can only flip where the top-2 gap is below the
sum of the two logits' errors, so 0.03 (3x that bound, 6x the measured error) is a gap no
bf16 run of this model flips. Steps below it may flip legitimately; after a flip the
contexts differ and the rest of that sequence is not compared. The test asserts that at
least MIN_COMPARED steps were compared, so it cannot pass vacuously (42 of 64 with bf16 on
the CPU).
"""

from __future__ import annotations

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_models import NanbeigeConfig, write_random_checkpoint
from test_family_nanbeige import CONFIG as EXACT_CONFIG
from test_family_nanbeige import ENGINE as CPU_ENGINE
from test_family_nanbeige import MAX_TOKENS as EXACT_MAX_TOKENS
from test_family_nanbeige import PROMPTS as EXACT_PROMPTS
from test_family_nanbeige import reference_greedy

pytestmark = pytest.mark.cuda

BF16_MARGIN = 0.03
BF16_LOGPROB_TOL = 0.03
MIN_COMPARED = 24
MAX_TOKENS = 16
PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3],
    [7],
]
CONFIG = NanbeigeConfig(
    vocab_size=320,
    hidden_size=96,  # not a power of two: masked rows in the fused kernels
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=32,
    num_loops=2,
    max_position_embeddings=256,
)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def engines():
    made = []

    def make(path, **options):
        llm = LLM(path, **{**CPU_ENGINE, **options})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert llm.engine.core.leak_report() == []
        llm.shutdown()


def assert_fast_path(llm):
    """The fused Triton path ran inside captured decode graphs."""
    runner = llm.engine.core.runner
    assert runner.graphs is not None and runner.graphs.replays > 0
    assert llm.engine.parts.model.fused_impl(runner.rows.hidden) == "triton"


def test_fp32_cuda_fused_graphs_equal_the_dense_reference(engines, tmp_path):
    path = write_random_checkpoint(tmp_path / "exact", EXACT_CONFIG, seed=11)
    llm = engines(path, device="cuda")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in EXACT_MAX_TOKENS]
    outputs = llm.generate(EXACT_PROMPTS, params)
    assert_fast_path(llm)
    for output, prompt, n in zip(outputs, EXACT_PROMPTS, EXACT_MAX_TOKENS, strict=True):
        assert output.token_ids == reference_greedy(path, prompt, n, EXACT_CONFIG.num_loops)
        assert output.exit_depths == [EXACT_CONFIG.num_loops] * n


def compare(reference, other, what):
    """Steps compared (tokens equal where the reference's top-2 gap exceeds BF16_MARGIN, while
    the contexts agree; logprobs within BF16_LOGPROB_TOL)."""
    compared = 0
    for ref, out in zip(reference, other, strict=True):
        assert len(out.token_ids) == MAX_TOKENS
        for i, (want, got) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            (_, first), (_, second) = ref.top_logprobs[i][:2]
            if first - second > BF16_MARGIN:
                compared += 1
                assert got == want, (
                    f"{what}: token {i} of {ref.request_id} (gap {first - second:.4f})"
                )
                assert out.logprobs[i] == pytest.approx(ref.logprobs[i], abs=BF16_LOGPROB_TOL)
            if got != want:  # a near-tie flipped: later steps see different contexts
                break
    return compared


def test_bf16_cuda_fused_and_eager_track_fp32(engines, tmp_path):
    path = write_random_checkpoint(tmp_path / "bf16", CONFIG, seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    fp32 = engines(path).generate(PROMPTS, params)
    fused_llm = engines(path, device="cuda", dtype="bfloat16")
    eager_llm = engines(path, device="cuda", dtype="bfloat16", fused_kernels=False)
    fused, eager = fused_llm.generate(PROMPTS, params), eager_llm.generate(PROMPTS, params)
    assert_fast_path(fused_llm)
    eager_runner = eager_llm.engine.core.runner
    assert eager_runner.graphs is not None and eager_runner.graphs.replays > 0
    assert eager_llm.engine.parts.model.fused_impl(eager_runner.rows.hidden) is None
    assert all(o.exit_depths == [CONFIG.num_loops] * MAX_TOKENS for o in fused + eager)
    assert compare(fp32, fused, "fused bf16 vs fp32") >= MIN_COMPARED
    assert compare(fp32, eager, "eager bf16 vs fp32") >= MIN_COMPARED
    # fused against eager: the same rule, the fp32 gaps deciding where a flip is excluded
    for ref, a, b in zip(fp32, fused, eager, strict=True):
        for i, (want, x, y) in enumerate(zip(ref.token_ids, a.token_ids, b.token_ids, strict=True)):
            (_, first), (_, second) = ref.top_logprobs[i][:2]
            if first - second > BF16_MARGIN:
                assert x == y, f"fused vs eager: token {i} of {ref.request_id}"
                assert x == want
                assert a.logprobs[i] == pytest.approx(b.logprobs[i], abs=BF16_LOGPROB_TOL)
            if not x == y == want:
                break
