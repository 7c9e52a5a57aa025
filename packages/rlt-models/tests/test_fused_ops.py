"""The Triton fused ops equal their torch references; the fused recurrent step equals the eager one.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set below, before
the kernels are first imported: `rlt_models.fused_ops` imports them lazily). The interpreter
rounds fp32 -> bf16 by truncation, unlike GPUs (round to nearest even), so the bf16 cases patch
its float conversion (`faithful_bf16`); fp32 and fp16 run unpatched. With CUDA the compiled
kernels run on the GPU and nothing is patched.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from rlt_models import (  # noqa: E402
    DenseCausalAttention,
    DenseKVCache,
    HrmTextConfig,
    NanbeigeConfig,
    OuroConfig,
    build_model,
    fused_ops,
    random_checkpoint_tensors,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}
EPS = 1e-6

if fused_ops.triton_unavailable_reason() is not None:
    pytest.skip(fused_ops.triton_unavailable_reason(), allow_module_level=True)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    if request.param == torch.bfloat16:
        request.getfixturevalue("faithful_bf16")
    return request.param


def randn(*shape, dtype, seed, scale=1.0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: max |diff| <= 1e-6 * max |expected|. fp16/bf16: at most one ulp anywhere and at
    least 90% of the elements bit-equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all()
    if actual.dtype == torch.float32:
        assert (a - e).abs().max() <= 1e-6 * e.abs().max()
        return
    magnitude = torch.maximum(a.abs(), e.abs()).clamp_min(2.0**-14)
    ulp = 2.0 ** (torch.floor(torch.log2(magnitude)) - MANTISSA_BITS[actual.dtype])
    assert ((a - e).abs() <= ulp).all(), f"max diff {(a - e).abs().max()}"
    assert (a == e).double().mean() >= 0.9


@pytest.mark.parametrize("hidden", [48, 80, 1000])
def test_rms_norm(dtype, hidden):
    x = randn(5, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=1, scale=0.1, offset=1.0)
    out = fused_ops.rms_norm(x, weight, EPS, impl="triton")
    assert_matches(out, fused_ops.rms_norm(x, weight, EPS, impl="torch"))


def test_rms_norm_reference_is_the_module():
    from rlt_models.layers import RMSNorm

    norm = RMSNorm(48, EPS).to(torch.bfloat16)
    norm.weight.data = randn(48, dtype=torch.bfloat16, seed=2, offset=1.0).cpu()
    x = randn(3, 48, dtype=torch.bfloat16, seed=3).cpu()
    assert torch.equal(fused_ops.rms_norm_reference(x, norm.weight, EPS), norm(x))


@pytest.mark.parametrize("norm_delta", [True, False], ids=["sandwich", "pre_norm"])
@pytest.mark.parametrize("hidden", [48, 80])
def test_add_rms_norm(dtype, hidden, norm_delta):
    residual = randn(6, hidden, dtype=dtype, seed=10, scale=4.0)
    delta = randn(6, hidden, dtype=dtype, seed=11, scale=0.5)
    delta_weight = (
        randn(hidden, dtype=dtype, seed=12, scale=0.1, offset=1.0) if norm_delta else None
    )
    out_weight = randn(hidden, dtype=dtype, seed=13, scale=0.1, offset=1.0)
    args = (residual, delta, delta_weight, out_weight, EPS)
    residual_before = residual.clone()
    new_residual, normed = fused_ops.add_rms_norm(*args, impl="triton")
    expected_residual, expected_normed = fused_ops.add_rms_norm(*args, impl="torch")
    assert torch.equal(residual, residual_before)  # inputs untouched
    assert_matches(new_residual, expected_residual)
    # Compare the second norm on the same rounded residual (a 1-ulp residual difference would
    # otherwise be compared through a second norm).
    assert_matches(normed, fused_ops.rms_norm(new_residual, out_weight, EPS, impl="torch"))
    if dtype == torch.float32:
        assert_matches(normed, expected_normed)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(3, 1, 16), (4, 4, 12), (2, 1, 40)]
)
def test_rotary_qk_in_place(dtype, num_heads, num_kv_heads, head_dim):
    rows = 4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(rows, width, dtype=dtype, seed=head_dim, scale=2.0)
    angles = randn(rows, head_dim // 2, dtype=torch.float32, seed=5, scale=3.0)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = fused_ops.rotary_qk_(
        qkv.clone(), cos, sin, num_heads, num_kv_heads, head_dim, impl="torch"
    )
    actual = qkv.clone()
    returned = fused_ops.rotary_qk_(
        actual, cos, sin, num_heads, num_kv_heads, head_dim, impl="triton"
    )
    assert returned is actual
    assert_matches(actual, expected)
    v_begin = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(actual[:, v_begin:], qkv[:, v_begin:])  # v untouched


def test_rotary_reference_equals_apply_rotary():
    from rlt_models.layers import apply_rotary

    heads, kv_heads, dim = 3, 1, 16
    qkv = randn(5, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, seed=8).cpu()
    cos = randn(5, dim, dtype=torch.bfloat16, seed=9).cpu()
    sin = randn(5, dim, dtype=torch.bfloat16, seed=10).cpu()
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    expected_q = apply_rotary(q.reshape(5, heads, dim), cos, sin)
    expected_k = apply_rotary(k.reshape(5, kv_heads, dim), cos, sin)
    out = fused_ops.rotary_qk_reference_(qkv.clone(), cos, sin, heads, kv_heads, dim)
    assert torch.equal(out[:, : heads * dim], expected_q.reshape(5, -1))
    assert torch.equal(out[:, heads * dim : (heads + kv_heads) * dim], expected_k.reshape(5, -1))
    assert torch.equal(out[:, (heads + kv_heads) * dim :], v)


@pytest.mark.parametrize("intermediate", [48, 80, 1100])
def test_silu_mul(dtype, intermediate):
    gate_up = randn(3, 2 * intermediate, dtype=dtype, seed=intermediate, scale=3.0)
    out = fused_ops.silu_mul(gate_up, intermediate, impl="triton")
    assert out.shape == (3, intermediate)
    assert_matches(out, fused_ops.silu_mul(gate_up, intermediate, impl="torch"))


@pytest.mark.parametrize("hidden", [48, 1000])
def test_exit_gate(dtype, hidden):
    h = randn(5, hidden, dtype=dtype, seed=hidden + 1, scale=2.0)
    weight = randn(hidden, dtype=torch.float32, seed=21, scale=0.1)
    bias = randn(1, dtype=torch.float32, seed=22)
    out = fused_ops.exit_gate(h, weight, bias, impl="triton")
    expected = fused_ops.exit_gate(h, weight, bias, impl="torch")
    assert out.dtype == torch.float32 and out.shape == (5,)
    # fp32 dot products summed in another order: a few ulp of the logit
    assert (out - expected).abs().max() <= 1e-6


def test_ops_accept_strided_rows_and_empty_batches():
    x = randn(4, 2 * 48, dtype=torch.float32, seed=20)[:, :48]  # row stride 96
    weight = randn(48, dtype=torch.float32, seed=21, offset=1.0)
    assert_matches(
        fused_ops.rms_norm(x, weight, EPS, impl="triton"),
        fused_ops.rms_norm(x, weight, EPS, impl="torch"),
    )
    empty = x[:0]
    assert fused_ops.rms_norm(empty, weight, EPS, impl="triton").shape == (0, 48)
    assert fused_ops.silu_mul(empty, 24, impl="triton").shape == (0, 24)


def test_impl_resolution():
    cpu = torch.zeros(2, 4)
    assert fused_ops.resolve_impl("auto", cpu) == "torch"
    assert fused_ops.resolve_impl("torch", cpu) == "torch"
    assert fused_ops.resolve_impl("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="impl must be one of"):
        fused_ops.resolve_impl("cuda", cpu)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    from rlt_models import fused_kernels

    monkeypatch.setattr(fused_kernels, "INTERPRETED", False)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        fused_ops.rms_norm(torch.zeros(2, 8), torch.ones(8), EPS, impl="triton")


# ---------------------------------------------------------------------------------------------
# the fused recurrent step

TINY = OuroConfig(
    vocab_size=64,
    hidden_size=48,  # not a power of two
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,  # GQA
    head_dim=16,
    total_ut_steps=2,
    max_position_embeddings=64,
)


TINY_FAMILIES = {
    "ouro": TINY,
    "nanbeige": NanbeigeConfig(  # pre-norm layers: add_rms_norm without a delta norm
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        num_loops=2,
        max_position_embeddings=64,
    ),
    "hrm_text": HrmTextConfig(  # gated attention, unit-weight norms, two stacks per loop
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_layers_per_stack=2,
        num_attention_heads=3,
        head_dim=16,
        H_cycles=2,
        L_cycles=2,
        max_position_embeddings=64,
        embedding_scale=10.0,
    ),
}


def tiny_model(dtype, family="ouro"):
    config = TINY_FAMILIES[family]
    return build_model(
        config, random_checkpoint_tensors(config, seed=5), dtype=dtype, device=DEVICE
    )


def run_loops(model, path, token_ids, loops=2):
    """Prefill all tokens at every loop, then one decode token; returns every loop's output
    (and its exit probability, for a family with a gate)."""
    model.fused_path = path
    caches = [DenseKVCache(model.shape.num_layers) for _ in range(loops)]
    outputs = []
    for tokens, first in ((token_ids[:-1], 0), (token_ids[-1:], len(token_ids) - 1)):
        h = model.embed(torch.tensor(tokens, device=DEVICE))
        positions = torch.arange(first, first + len(tokens), device=DEVICE)
        for loop in range(loops):
            h, probs = model.recurrent_step(h, positions, DenseCausalAttention(caches[loop]))
            outputs += [h] if probs is None else [h, probs]
    return outputs


TOKENS = [3, 17, 42, 8, 61, 5]
FAMILIES = pytest.mark.parametrize("family", sorted(TINY_FAMILIES))


@FAMILIES
def test_fused_triton_step_matches_eager_fp32(family):
    model = tiny_model(torch.float32, family)
    eager = run_loops(model, "off", TOKENS)
    fused = run_loops(model, "triton", TOKENS)
    for a, e in zip(fused, eager, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert (a.double() - e.double()).abs().max() <= 1e-5 * e.double().abs().max()


@FAMILIES
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_fused_torch_step_is_bit_identical_to_eager(model_dtype, family):
    model = tiny_model(model_dtype, family)
    eager = run_loops(model, "off", TOKENS)
    fused = run_loops(model, "torch", TOKENS)
    for a, e in zip(fused, eager, strict=True):
        assert torch.equal(a, e)


@FAMILIES
def test_fused_triton_step_tracks_eager_bf16(faithful_bf16, family):
    model = tiny_model(torch.bfloat16, family)
    eager = run_loops(model, "off", TOKENS)
    fused = run_loops(model, "triton", TOKENS)
    for a, e in zip(fused, eager, strict=True):
        # isolated 1-ulp differences propagate through later layers: loose bound only
        assert (a.double() - e.double()).abs().max() <= 3e-2 * e.double().abs().max()


def test_fused_path_selection():
    model = tiny_model(torch.float32)
    cpu_hidden = torch.zeros(1, TINY.hidden_size)
    assert model.fused_path == "auto"
    assert model.fused_impl(cpu_hidden) is None  # CPU: eager path, today's numerics
    model.fused_path = "triton"
    assert model.fused_impl(cpu_hidden) == "triton"
    model.fused_path = "torch"
    assert model.fused_impl(cpu_hidden) == "torch"
    model.fused_path = "off"
    assert model.fused_impl(cpu_hidden) is None
    model.fused_path = "fast"
    with pytest.raises(ValueError, match="fused_path must be one of"):
        model.fused_impl(cpu_hidden)


@pytest.mark.cuda
def test_auto_uses_triton_on_cuda():
    model = tiny_model(torch.bfloat16)
    assert model.fused_impl(torch.zeros(1, TINY.hidden_size, device="cuda")) == "triton"
