"""TritonPagedAttention matches the torch backend and the naive reference.

Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1): these
cases are kept small. fp32 and fp16 only: the interpreter's bf16 `tl.dot` is not meaningful, so
bf16 is checked on a GPU (test_cuda_backends.py).
"""

from __future__ import annotations

import pytest
import torch
from rlt_attention import TorchPagedAttention, TritonPagedAttention

MIXED_GROUPS = [(1, 9), (5, 5), (3, 17), (1, 1), (4, 12), (0, 0)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 2, 16), (3, 6, 2, 12), (1, 2, 2, 8), (16, 8, 1, 32)],
)
def test_fp32_matches_torch_backend_and_reference(
    paged_case, reference, block_size, num_heads, num_kv_heads, head_dim
):
    kwargs = dict(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=DEVICE,
    )
    triton_case = paged_case(MIXED_GROUPS, **kwargs)
    torch_case = paged_case(MIXED_GROUPS, **kwargs)
    out = triton_case.run(TritonPagedAttention())
    expected = torch_case.run(TorchPagedAttention())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double().cpu(), reference(triton_case), rtol=1e-5, atol=1e-5)
    # Same writes as the torch backend (both follow write_slots of the called layer only).
    torch.testing.assert_close(
        triton_case.kv_cache.key_cache,
        torch_case.kv_cache.key_cache,
        rtol=0,
        atol=0,
        equal_nan=True,
    )
    torch.testing.assert_close(
        triton_case.kv_cache.value_cache,
        torch_case.kv_cache.value_cache,
        rtol=0,
        atol=0,
        equal_nan=True,
    )


def test_small_tiles_cross_query_and_key_tiles(paged_case, reference):
    """16-row tiles with G=2 hold 8 queries: a 20-query chunk spans 3 tiles, 41 keys 3 key steps."""
    case = paged_case([(20, 41), (1, 23), (9, 9)], block_size=4, head_dim=16, seed=2, device=DEVICE)
    out = case.run(TritonPagedAttention(block_m=16, block_n=16))
    torch.testing.assert_close(out.double().cpu(), reference(case), rtol=1e-5, atol=1e-5)


def test_fp16_matches_reference(paged_case, reference):
    case = paged_case(
        MIXED_GROUPS, block_size=4, head_dim=16, dtype=torch.float16, seed=4, device=DEVICE
    )
    out = case.run(TritonPagedAttention())
    assert out.dtype == torch.float16
    # Probabilities are rounded to fp16 before the P @ V product (as flash attention does).
    torch.testing.assert_close(out.double().cpu(), reference(case), rtol=2e-3, atol=2e-3)


def test_unread_slots_never_influence_output(paged_case):
    case = paged_case(MIXED_GROUPS, block_size=3, head_dim=16, seed=7, device=DEVICE)
    out_nan = case.run(TritonPagedAttention())
    for cache in (case.kv_cache.key_cache, case.kv_cache.value_cache):
        cache[torch.isnan(cache)] = 1e4
    out_huge = case.run(TritonPagedAttention())
    assert torch.isfinite(out_nan).all()
    torch.testing.assert_close(out_huge, out_nan, rtol=0, atol=0)


def test_cpu_tensors_without_interpreter_are_refused(paged_case, monkeypatch):
    from rlt_attention import triton_kernel

    monkeypatch.setattr(triton_kernel, "INTERPRETED", False)
    case = paged_case(MIXED_GROUPS, block_size=4)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        TritonPagedAttention().bind(case.kv_cache, case.batch)


def test_bidirectional_groups_see_their_whole_context(paged_case, reference):
    """`causal=False`: the prefill kernel's rows read their group's whole context (tiles of 16
    rows so a 20-query group spans several query tiles)."""
    import dataclasses

    case = paged_case([(20, 20), (3, 11), (1, 4)], block_size=4, head_dim=16, seed=3, device=DEVICE)
    case.batch = dataclasses.replace(case.batch, causal=False)
    out = case.run(TritonPagedAttention(block_m=16, block_n=16))
    torch.testing.assert_close(
        out.double().cpu(), reference(case, causal=False), rtol=1e-5, atol=1e-5
    )
