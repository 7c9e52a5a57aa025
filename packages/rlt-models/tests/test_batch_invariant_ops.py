"""Batch-invariant ops (`rlt_models.batch_invariant`, `OuroModel.batch_invariant`).

The property: a row's result is bitwise the same whatever the row count, the other rows and the
row's position. Checked for every projection shape of the tiny test models and of the bundled
model, in fp32 and bf16, with the thread count this process runs with (CPU). The same checks
against plain `F.linear` document why the mode exists: they fail there on this CPU build.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rlt_models import batch_invariant

# (N, K) of qkv / o / gate_up / down / lm_head / gate of the tiny models and the bundled model
SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128), (320, 64), (1, 64)]
SHAPES += [(768, 256), (256, 256), (1536, 256), (256, 768), (4096, 256), (1, 256)]
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33)
DTYPES = (torch.float32, torch.bfloat16)


def _rows_in_batches(fn, pool: torch.Tensor, probe: torch.Tensor) -> list[torch.Tensor]:
    """fn's result for `probe` placed at several positions among other rows of several counts."""
    results = []
    for count in ROW_COUNTS:
        for position in {0, count // 2, count - 1}:
            rows = pool[:count].clone()
            rows[position] = probe
            results.append(fn(rows)[position])
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_row_result_is_independent_of_the_batch(shape, dtype):
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k).to(dtype)
    pool = torch.randn(40, k).to(dtype)
    probe = torch.randn(k).to(dtype)
    results = _rows_in_batches(lambda x: batch_invariant.linear(x, weight), pool, probe)
    assert all(torch.equal(r, results[0]) for r in results)
    # and it is a linear map: close to F.linear (fp32 accumulation either way)
    reference = F.linear(probe[None].double(), weight.double())[0]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(results[0].double(), reference, rtol=tolerance, atol=tolerance)


def test_plain_linear_is_not_batch_invariant_here():
    """Why the mode exists (this CPU build, MKL): fp32 F.linear of one row differs with M."""
    torch.manual_seed(0)
    weight, pool, probe = torch.randn(768, 256), torch.randn(40, 256), torch.randn(256)
    results = _rows_in_batches(lambda x: F.linear(x, weight), pool, probe)
    if all(torch.equal(r, results[0]) for r in results):
        pytest.skip("this BLAS happens to be row-invariant for this shape")
    assert not all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("name", "fn", "reference"),
    [
        ("silu", batch_invariant.silu, F.silu),
        ("sigmoid", batch_invariant.sigmoid, torch.sigmoid),
    ],
)
def test_elementwise_ops_do_not_depend_on_position(name, fn, reference, dtype):
    torch.manual_seed(1)
    width = 96 if name == "silu" else 1
    pool = (torch.randn(2000, width) * 4).to(dtype)
    one_by_one = torch.cat([fn(pool[i : i + 1]) for i in range(len(pool))])
    for count in (2, 31, 33, 64, 100, 2000):
        for start in (0, 7):
            assert torch.equal(fn(pool[start : start + count]), one_by_one[start : start + count])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(one_by_one.float(), reference(pool).float(), atol=tolerance)


def test_triton_linear_matches_f_linear_in_the_interpreter():
    """The CUDA kernel's arithmetic, run by Triton's interpreter on the CPU (fp32 only: the
    interpreter's bf16 dot is not the GPU's). Says nothing about GPU invariance or speed."""
    if batch_invariant.triton is None or not batch_invariant.INTERPRETED:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set without CUDA)")
    torch.manual_seed(2)
    weight = torch.randn(80, 48)
    x = torch.randn(70, 48)
    out = batch_invariant.triton_linear(x, weight)
    assert torch.allclose(out, F.linear(x, weight), atol=1e-4)
    assert torch.equal(batch_invariant.triton_linear(x[3:4], weight)[0], out[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariant_model_loop_is_row_invariant_and_close_to_default(tiny_checkpoint, dtype):
    """One recurrent step + gate + LM head over a dense causal attention per row: the
    batch-invariant model computes every row as it does alone, and stays within rounding of
    the default numerics."""
    from rlt_models import load_model

    model = load_model(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3), dtype=None, device="cpu")
    model = model.to(dtype)
    torch.manual_seed(3)
    hidden = torch.randn(9, model.shape.hidden_size).to(dtype)
    positions = torch.arange(9)

    def step(rows: torch.Tensor, pos: torch.Tensor):
        attention = _SelfOnlyAttention()
        out, gate = model.recurrent_step(rows, pos, attention)
        return out, gate, model.coda(out)

    model.batch_invariant = True
    together = step(hidden, positions)
    for row in range(9):
        alone = step(hidden[row : row + 1], positions[row : row + 1])
        assert all(torch.equal(a[0], t[row]) for a, t in zip(alone, together, strict=True))
    model.batch_invariant = False
    default = step(hidden, positions)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for invariant, plain in zip(together, default, strict=True):
        assert torch.allclose(invariant.float(), plain.float(), atol=tolerance, rtol=tolerance)


class _SelfOnlyAttention:
    """Each row attends to its own key only (attention output = its value): row-local, so the
    test isolates the model's own ops."""

    def __call__(self, layer_index, query, key, value):
        group = query.shape[1] // key.shape[1]
        return value.repeat_interleave(group, dim=1).to(query.dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 5632)])
def test_cuda_linear_row_result_is_independent_of_the_batch(shape, dtype):
    """On a GPU the Triton GEMM (never run yet): the same row property, for Ouro-1.4B shapes
    and row counts up to a prefill chunk."""
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k, device="cuda").to(dtype)
    pool = torch.randn(300, k, device="cuda").to(dtype)
    probe = torch.randn(k, device="cuda").to(dtype)
    results = []
    for count in (1, 2, 7, 16, 17, 64, 65, 128, 300):
        for position in {0, count // 2, count - 1}:
            rows = pool[:count].clone()
            rows[position] = probe
            results.append(batch_invariant.linear(rows, weight)[position])
    assert all(torch.equal(r, results[0]) for r in results)
    reference = F.linear(probe[None].double(), weight.double())[0]
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    assert torch.allclose(results[0].double(), reference, rtol=tolerance, atol=tolerance)
