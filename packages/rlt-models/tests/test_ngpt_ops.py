"""The nGPT layer's fused ops (Dory): each Triton kernel against its torch reference, the torch
references against the eager layer, and a whole tiny Dory on the fused path against eager.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set below,
before `rlt_models.ngpt_ops` first imports them); the bf16 cases make the interpreter round
fp32 -> bf16 to nearest even as GPUs do (it truncates otherwise), like tests/test_fused_ops.py.

Tolerance of a kernel against its reference (`assert_close`): both round the same fp32 values
to the act dtype at the same places, except that the kernel sums squares in another order and
its exp / sqrt may differ by an fp32 ulp. An intermediate can therefore land one act-dtype ulp
away; later roundings and the final unit norm carry that into the output as a few ulps of the
row's largest element (cancellation in a sum makes a small element's relative error large,
never its absolute one). Bound: max |diff| <= 4 ulp(max |expected|) (fp32: 1e-6 x max,
the interpreter's summation order), and at least 90% of the elements bit-equal in fp16/bf16.
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
    build_model,
    fused_ops,
    ngpt_ops,
    random_checkpoint_tensors,
)
from rlt_models.dense_attention import dense_causal_attention  # noqa: E402
from rlt_models.dory_config import FULL, SLIDING, DoryConfig  # noqa: E402
from rlt_models.layers import apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}

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


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The module doc's bound."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all()
    largest = e.abs().max()
    if actual.dtype == torch.float32:
        assert (a - e).abs().max() <= 1e-6 * largest
        return
    ulp = 2.0 ** (torch.floor(torch.log2(largest)) - MANTISSA_BITS[actual.dtype])
    assert (a - e).abs().max() <= 4 * ulp, f"max diff {(a - e).abs().max()}, ulp {ulp}"
    assert (a == e).double().mean() >= 0.9


@pytest.mark.parametrize("width", [48, 80])
def test_unit_norm(dtype, width):
    x = randn(5, width, dtype=dtype, seed=width, scale=3.0)
    out = ngpt_ops.unit_norm(x, impl="triton")
    assert_close(out, ngpt_ops.unit_norm(x, impl="torch"))
    assert torch.allclose(
        out.double().norm(dim=-1).cpu(), torch.ones(5, dtype=torch.float64), atol=1e-2
    )


def test_unit_add_unit_on_the_halves_of_a_state(dtype):
    state = randn(4, 2 * 48, dtype=dtype, seed=3, scale=2.0)  # [h, inject]: row stride 96
    h, inject = state.split(48, dim=-1)
    assert_close(
        ngpt_ops.unit_add_unit(h, inject, impl="triton"),
        ngpt_ops.unit_add_unit(h, inject, impl="torch"),
    )


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 12), (2, 2, 40)])
def test_qk_unit_rope_scale_in_place(dtype, heads, kv_heads, head_dim):
    rows = 3
    qkvg = randn(rows, (2 * heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim, scale=2)
    angles = randn(rows, head_dim // 2, dtype=torch.float32, seed=5, scale=3.0)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_scale = randn(heads * head_dim, dtype=dtype, seed=6, scale=0.5, offset=head_dim**0.5)
    args = (cos, sin, heads, kv_heads, head_dim, q_scale)
    expected = qkvg.clone()
    q_ref, k_ref = ngpt_ops.qk_unit_rope_scale_(expected, *args, impl="torch")
    actual = qkvg.clone()
    q, k = ngpt_ops.qk_unit_rope_scale_(actual, *args, impl="triton")
    assert q.shape == (rows, heads, head_dim) and k.shape == (rows, kv_heads, head_dim)
    assert q.data_ptr() == actual.data_ptr()  # views of the packed projection
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    untouched = (heads + kv_heads) * head_dim  # v and gate
    assert torch.equal(actual[:, untouched:], qkvg[:, untouched:])


def test_qk_reference_is_the_eager_expression():
    heads, kv_heads, head_dim, n = 3, 1, 16, 4
    qkvg = randn(n, (2 * heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, seed=7).cpu()
    cos, sin = (randn(n, head_dim, dtype=torch.bfloat16, seed=s).cpu() for s in (8, 9))
    q_scale = randn(heads * head_dim, dtype=torch.bfloat16, seed=10, offset=4.0).cpu()
    q, k, _, _ = qkvg.split((heads * head_dim, kv_heads * head_dim) * 2, dim=-1)
    unit = ngpt_ops.unit_reference
    want_q = apply_rotary(unit(q.reshape(n, heads, head_dim)), cos, sin) * q_scale.view(
        heads, head_dim
    )
    want_k = apply_rotary(unit(k.reshape(n, kv_heads, head_dim)), cos, sin)
    got_q, got_k = ngpt_ops.qk_unit_rope_scale_(
        qkvg.clone(), cos, sin, heads, kv_heads, head_dim, q_scale, impl="torch"
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("width", [48, 80])
def test_gated_unit_with_the_gate_a_view_of_the_projection(dtype, width):
    packed = randn(4, 3 * width, dtype=dtype, seed=width + 1, scale=2.0)
    out, gate = packed[:, :width].contiguous(), packed[:, 2 * width :]  # gate: row stride 3w
    gate_scale = randn(width, dtype=dtype, seed=12, scale=0.5, offset=1.0) ** 2
    assert_close(
        ngpt_ops.gated_unit(out, gate, gate_scale, impl="triton"),
        ngpt_ops.gated_unit(out, gate, gate_scale, impl="torch"),
    )


@pytest.mark.parametrize("width", [48, 80])
def test_unit_interpolate(dtype, width):
    x = ngpt_ops.unit_reference(randn(5, width, dtype=dtype, seed=width + 2))
    raw = randn(5, width, dtype=dtype, seed=width + 3, scale=4.0)
    rate = randn(width, dtype=dtype, seed=14, scale=0.2, offset=0.4).abs()
    h, y = ngpt_ops.unit_interpolate(x, raw, rate, keep_h=True, impl="triton")
    h_ref, y_ref = ngpt_ops.unit_interpolate(x, raw, rate, keep_h=True, impl="torch")
    assert_close(h, h_ref)
    assert_close(y, y_ref)
    none, y_only = ngpt_ops.unit_interpolate(x, raw, rate, keep_h=False, impl="triton")
    assert none is None and torch.equal(y_only, y)


@pytest.mark.parametrize("intermediate", [48, 80, 1100])
def test_scaled_silu_unit(dtype, intermediate):
    gate_up = randn(3, 2 * intermediate, dtype=dtype, seed=intermediate, scale=0.3)
    scales = [randn(intermediate, dtype=dtype, seed=s, scale=1.0, offset=6.0) for s in (15, 16)]
    out = ngpt_ops.scaled_silu_unit(gate_up, *scales, intermediate, impl="triton")
    assert out.shape == (3, intermediate)
    assert_close(out, ngpt_ops.scaled_silu_unit(gate_up, *scales, intermediate, impl="torch"))


def test_empty_batches_and_cpu_tensors_without_the_interpreter(monkeypatch):
    x = randn(0, 48, dtype=torch.float32, seed=1)
    ones = torch.ones(48, device=DEVICE)
    assert ngpt_ops.unit_norm(x, impl="triton").shape == (0, 48)
    assert ngpt_ops.unit_add_unit(x, x, impl="triton").shape == (0, 48)
    assert ngpt_ops.gated_unit(x, x, ones, impl="triton").shape == (0, 48)
    assert ngpt_ops.unit_interpolate(x, x, ones, keep_h=True, impl="triton")[0].shape == (0, 48)
    assert ngpt_ops.scaled_silu_unit(x, ones[:24], ones[:24], 24, impl="triton").shape == (0, 24)
    from rlt_models import fused_kernels

    monkeypatch.setattr(fused_kernels, "INTERPRETED", False)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        ngpt_ops.unit_norm(torch.zeros(2, 8), impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        ngpt_ops.unit_norm(torch.zeros(2, 8), impl="cuda")


# ---------------------------------------------------------------------------------------------
# a tiny Dory: the fused path against eager

CONFIG = DoryConfig(
    vocab_size=64,
    hidden_size=48,  # not a power of two: masked lanes in every row kernel
    intermediate_size=80,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=16,
    n_input_layers=1,
    n_recurrent_layers=2,
    n_output_layers=1,
    n_recurrent_loops=2,
    max_position_embeddings=64,
    layer_types=(SLIDING, FULL, SLIDING, FULL),
    sliding_window=3,
)
TOKENS = [3, 17, 42, 8, 61, 5]


def tiny_dory(dtype):
    """Random weights with the learned scales near their init values (as transformers
    initialises them) and spread, so that a misplaced scale changes the outputs."""
    tensors = random_checkpoint_tensors(CONFIG, seed=1)
    gen = torch.Generator().manual_seed(2)
    for name, tensor in tensors.items():
        spread = 0.5 + torch.rand(tensor.shape, generator=gen)
        if any(key in name for key in ("sqk", "s_gate", "lambda_", "logit_scale")):
            tensors[name] = CONFIG.initializer_range * spread
        elif "suv_" in name:
            tensors[name] = spread
    return build_model(CONFIG, tensors, dtype=dtype, device=DEVICE)


def run_tokens(model, path, tokens=TOKENS, loops=2):
    """Prompt tokens[:-1] in one call, then the last token: every stage's output and the
    logits of each call."""
    model.fused_path = path
    stage = DenseKVCache(CONFIG.n_input_layers + CONFIG.n_output_layers)
    caches = [DenseKVCache(CONFIG.n_recurrent_layers) for _ in range(loops)]
    outputs = []
    for chunk, first in ((tokens[:-1], 0), (tokens[-1:], len(tokens) - 1)):
        positions = torch.arange(first, first + len(chunk), device=DEVICE)
        hidden = model.embed(
            torch.tensor(chunk, device=DEVICE), positions, DenseCausalAttention(stage)
        )
        outputs.append(hidden)
        for loop in range(loops):
            hidden, gate = model.recurrent_step(
                hidden, positions, DenseCausalAttention(caches[loop])
            )
            assert gate is None
            outputs.append(hidden)
        hidden = model.finish(hidden, positions, DenseCausalAttention(stage))
        outputs += [hidden, model.coda(hidden)]
    return outputs


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_fused_torch_path_is_bit_identical_to_eager(model_dtype):
    model = tiny_dory(model_dtype)
    eager = run_tokens(model, "off")
    for a, e in zip(run_tokens(model, "torch"), eager, strict=True):
        assert torch.equal(a, e)


def test_fused_triton_path_matches_eager_fp32():
    model = tiny_dory(torch.float32)
    eager = run_tokens(model, "off")
    for a, e in zip(run_tokens(model, "triton"), eager, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        # fp32 sums in another order through 8 layer applications: rounding-level drift
        assert (a.double() - e.double()).abs().max() <= 1e-5 * e.double().abs().max()


def test_fused_triton_path_tracks_eager_bf16(faithful_bf16):
    model = tiny_dory(torch.bfloat16)
    eager = run_tokens(model, "off")
    for a, e in zip(run_tokens(model, "triton"), eager, strict=True):
        # isolated 1-ulp differences propagate through later layers: a loose bound only
        assert (a.double() - e.double()).abs().max() <= 3e-2 * e.double().abs().max()


class RowAlone:
    """A `LayerAttention` under which rows are independent: each query attends to its own key
    and value only (as a batch of one-token sequences at position 0)."""

    def __call__(self, slot, query, key, value, *, window=None):
        return torch.cat(
            [
                dense_causal_attention(query[i : i + 1], key[i : i + 1], value[i : i + 1])
                for i in range(query.shape[0])
            ]
        )


def test_batch_invariant_fused_path_computes_each_row_alone():
    """In batch-invariant mode the fused path projects through the batch-invariant GEMM (F.linear
    rounds one row differently from five on this CPU), and its kernels work row by row."""
    model = tiny_dory(torch.float32)
    model.batch_invariant, model.fused_path = True, "triton"
    tokens = torch.tensor([3, 17, 42, 8, 61], device=DEVICE)
    positions = torch.zeros(5, dtype=torch.long, device=DEVICE)

    def step(rows):
        hidden = model.embed(tokens[rows], positions[rows], RowAlone())
        hidden, _ = model.recurrent_step(hidden, positions[rows], RowAlone())
        return model.coda(model.finish(hidden, positions[rows], RowAlone()))

    together = step(slice(0, 5))
    for row in range(5):
        assert torch.equal(step(slice(row, row + 1))[0], together[row])


def test_derived_scales_are_kept_and_follow_a_dtype_change():
    model = tiny_dory(torch.float32)
    layer = model.layers[0]
    first = layer.constants()
    assert layer.constants() is first  # kept, not recomputed
    assert torch.equal(first.q_scale, (layer.sqk * layer.sqk_scale).square())
    assert torch.equal(first.mlp_rate, (layer.lambda_2 * layer.lambda_scale).abs())
    model.to(torch.bfloat16)
    again = layer.constants()
    assert again.gate_scale.dtype == torch.bfloat16
    assert torch.equal(again.gate_scale, (layer.s_gate * layer.s_gate_scale).square())
    assert torch.equal(again.suv_up, layer.suv_up * layer.suv_scale)
