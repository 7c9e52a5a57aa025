"""GPU checks (skipped without CUDA): compiled Triton kernel vs torch backend in every dtype,
no host sync in bind or in the per-layer call, and CUDA-graph replay with rewritten metadata."""

from __future__ import annotations

import pytest
import torch
from rlt_attention import TorchPagedAttention, TritonPagedAttention

pytestmark = pytest.mark.cuda

# Decode rows over long contexts and prefill chunks (first and continuing) in one call.
GROUPS = [(1, 300), (1, 17), (64, 64), (1, 129), (37, 250), (100, 160), (1, 1)]
# Triton rounds softmax probabilities to the cache dtype before P @ V (flash-attention style);
# the torch backend keeps them in fp32. Tolerances cover that rounding plus the output's.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(16, 16, 16, 128), (16, 16, 4, 64), (5, 8, 2, 96), (32, 4, 2, 256)],
)
def test_triton_matches_torch_on_gpu(
    paged_case, dtype, block_size, num_heads, num_kv_heads, head_dim
):
    kwargs = dict(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )
    triton_case, torch_case = paged_case(GROUPS, **kwargs), paged_case(GROUPS, **kwargs)
    out = triton_case.run(TritonPagedAttention())
    expected = torch_case.run(TorchPagedAttention())
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(
        triton_case.kv_cache.key_cache,
        torch_case.kv_cache.key_cache,
        rtol=0,
        atol=0,
        equal_nan=True,
    )


def test_torch_backend_matches_reference_on_gpu(paged_case, reference):
    case = paged_case(
        GROUPS[:4], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, device="cuda"
    )
    out = case.run(TorchPagedAttention())
    torch.testing.assert_close(out.double().cpu(), reference(case), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "backend", [TorchPagedAttention(), TritonPagedAttention()], ids=["torch", "triton"]
)
def test_bind_and_layer_calls_do_not_sync(paged_case, backend):
    case = paged_case(
        GROUPS,
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device="cuda",
    )
    case.assert_calls_do_not_sync(backend)


def test_triton_layer_call_replays_in_a_cuda_graph(paged_case):
    """Capture one layer call, rewrite cache + metadata in place for another batch, replay."""
    shapes = dict(
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        num_blocks=96,
        max_pages=24,
        device="cuda",
    )
    captured = paged_case([(1, 40), (1, 300), (8, 20)], seed=1, **shapes)
    replayed = paged_case(
        [(1, 333), (1, 7), (8, 150)], seed=2, **shapes
    )  # same S, N, max_query_len
    attention = TritonPagedAttention().bind(captured.kv_cache, captured.batch)
    query, key, value = captured.query.clone(), captured.key.clone(), captured.value.clone()
    attention(captured.layer_index, query, key, value)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(captured.layer_index, query, key, value)

    captured.kv_cache.key_cache.copy_(replayed.kv_cache.key_cache)
    captured.kv_cache.value_cache.copy_(replayed.kv_cache.value_cache)
    for name in ("query_start", "context_lengths", "block_tables", "write_slots"):
        getattr(captured.batch, name).copy_(getattr(replayed.batch, name))
    query.copy_(replayed.query), key.copy_(replayed.key), value.copy_(replayed.value)
    graph.replay()

    expected = replayed.run(TritonPagedAttention())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        captured.kv_cache.key_cache, replayed.kv_cache.key_cache, rtol=0, atol=0, equal_nan=True
    )
