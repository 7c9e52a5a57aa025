"""fp8 projections (rlt_models.fp8_linear): the weight-only Triton kernels and W8A8 compute the
dequantized weight's product, the selector only picks candidates that do, the chosen kernels run
sync-free under CUDA-graph capture, and every other path is the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rlt_models import batch_invariant
from rlt_models import fp8_linear as fl
from rlt_models import small_batch_linear as sbl
from rlt_models.fp8 import Fp8Projection, quantize_per_channel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    sbl.triton is None or (DEVICE == "cpu" and not sbl.INTERPRETED),
    reason="needs CUDA, or TRITON_INTERPRET=1 before import",
)


def _weight(n: int, k: int, seed: int) -> Fp8Projection:
    generator = torch.Generator().manual_seed(seed)
    return Fp8Projection(*quantize_per_channel(torch.randn(n, k, generator=generator) * 0.05))


def _reference(x: torch.Tensor, weight: Fp8Projection) -> torch.Tensor:
    return F.linear(x.float(), weight.dequantized(torch.float32).to(x.device))


@needs_kernels
@pytest.mark.parametrize("config", [sbl.CONFIGS[0], sbl.CONFIGS[6], sbl.CONFIGS[9]])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 80), (3, 33, 300), (16, 64, 256)])
def test_weight_only_kernel_applies_the_channel_scales(config, rows, n, k):
    if config.single_row and rows != 1:
        pytest.skip("the single-row kernel takes one row")
    weight = _weight(n, k, rows * n + k).to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).half().to(DEVICE)
    out = sbl.launch(x, weight.weight, config, scale=weight.scale)
    assert out.dtype == torch.float16 and out.shape == (rows, n)
    # e4m3 widens exactly to fp16; fp32 accumulation, one rounding to fp16 (relative 2**-11)
    reference = _reference(x, weight)
    assert torch.allclose(out.float(), reference, rtol=2e-3, atol=2e-3 * reference.abs().max())


@needs_kernels
def test_weight_only_kernel_honours_the_needed_flag():
    weight = _weight(40, 96, 3).to(DEVICE)
    x = torch.randn(1, 96).half().to(DEVICE)
    config = sbl.CONFIGS[6]
    plain = sbl.launch(x, weight.weight, config, scale=weight.scale)
    flag = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(sbl.launch(x, weight.weight, config, flag, scale=weight.scale), plain)
    flag.zero_()
    assert not sbl.launch(x, weight.weight, config, flag, scale=weight.scale).any()


def test_cpu_and_reference_linears_take_the_dequantized_weight():
    """Off the CUDA fast path every fp8 projection is dequantize-then-linear, exactly."""
    weight = _weight(24, 32, 1)
    x = torch.randn(5, 32)
    expected = F.linear(x, weight.dequantized(torch.float32))
    for linear in (sbl.small_batch_linear, F.linear, batch_invariant.linear):
        assert torch.equal(fl.project(linear, x, weight), expected)
    assert fl.fp8_linear.choices == {}  # nothing measured on the CPU
    plain = torch.randn(24, 32)
    assert torch.equal(fl.project(sbl.small_batch_linear, x, plain), F.linear(x, plain))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantize_rows_and_w8a8_match_the_reference():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = fl.quantize_rows(x)
    assert scale.shape == (37, 1)
    torch.testing.assert_close(scale[:, 0], x.float().abs().amax(dim=1) / 448, rtol=1e-6, atol=0)
    # e4m3 rounds to 3 mantissa bits: at most 2**-4 relative for normals, and 2**-10 x scale
    # absolute below 2**-6 x scale (subnormals)
    bound = x.float().abs() * 2**-4 + scale * 2**-10
    assert ((q.float() * scale - x.float()).abs() <= bound).all()
    weight = _weight(96, 256, 9).to("cuda")
    out = fl.w8a8(x, weight.weight, weight.scale)
    reference = _reference(x, weight)
    assert out.dtype == torch.bfloat16
    # the activation rounding (std ~2**-5.5 relative, independent across K) and a bf16 output
    assert (out.float() - reference).abs().max() <= 0.05 * reference.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_selection_is_correct_and_graph_capturable_without_syncs(rows):
    selector = fl.Fp8Linear()
    weight = _weight(1024, 512, rows).to("cuda")
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    eager = selector(x, weight)  # measures once (up to 16 rows), outside any capture
    if rows <= sbl.MAX_ROWS:
        (choice,) = selector.choices.values()
    else:  # no measurement: W8A8 where _scaled_mm applies
        assert selector.choices == {}
        eligible = selector.w8a8_eligible(weight.weight, x.dtype)
        choice = fl.W8A8_CHOICE if eligible else fl.DEQUANTIZE_CHOICE
    reference = _reference(x, weight)
    bound = fl.TOLERANCE[choice.kind] * reference.abs().max()
    assert (eager.float() - reference).abs().max() <= bound
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = selector(x, weight)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    again = _reference(x, weight)
    assert (captured.float() - again).abs().max() <= fl.TOLERANCE[choice.kind] * again.abs().max()
    assert len(selector.choices) == (1 if rows <= sbl.MAX_ROWS else 0)
