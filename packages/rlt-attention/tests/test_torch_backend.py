"""TorchPagedAttention against a naive fp64 per-query reference on paged, poisoned caches."""

from __future__ import annotations

import pytest
import torch
from rlt_attention import TorchPagedAttention
from rlt_contracts import KVCacheTensors

# Decode rows (q_len 1), a first prefill chunk (q_len == context), continuing chunks
# (q_len < context), a one-token context and an empty group, in one call.
MIXED_GROUPS = [(1, 9), (5, 5), (3, 17), (1, 1), (4, 12), (0, 0)]

# Output tolerance: inputs are identical (k/v rounded to the cache dtype in both); the backend
# computes in fp32 and rounds the output once to the query dtype.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def run_layer(backend, case, layer_index=None, key=None, value=None):
    attention = backend.bind(case.kv_cache, case.batch)
    layer = case.layer_index if layer_index is None else layer_index
    return attention(
        layer, case.query, case.key if key is None else key, case.value if value is None else value
    )


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (4, 1), (2, 2)])
def test_mixed_groups_match_naive_reference(
    paged_case, reference, block_size, num_heads, num_kv_heads
):
    case = paged_case(
        MIXED_GROUPS, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    out = run_layer(TorchPagedAttention(), case)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(
        out.double(), reference(case), rtol=TOLERANCE[torch.float32], atol=TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_caches_match_reference(paged_case, reference, dtype):
    case = paged_case(MIXED_GROUPS, block_size=4, dtype=dtype, head_dim=16, seed=3)
    out = run_layer(TorchPagedAttention(), case)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.double(), reference(case), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]
    )


def test_long_context_crosses_many_pages(paged_case, reference):
    # 70 positions over 70 one-slot pages (and 24 three-slot pages), two prefill chunks + decode.
    for block_size in (1, 3):
        case = paged_case([(1, 70), (6, 40), (33, 33)], block_size=block_size, seed=5)
        torch.testing.assert_close(
            run_layer(TorchPagedAttention(), case).double(), reference(case), rtol=1e-5, atol=2e-6
        )


def test_writes_land_at_write_slots_of_the_called_layer_only(paged_case):
    case = paged_case(MIXED_GROUPS, block_size=4)
    run_layer(TorchPagedAttention(), case)
    key_cache, value_cache = case.kv_cache.key_cache, case.kv_cache.value_cache
    layers, blocks, block_size, kv_heads, head_dim = key_cache.shape
    slots = case.batch.write_slots
    expected_keys = case.key_cache_before.clone().view(layers, -1, kv_heads, head_dim)
    expected_values = case.value_cache_before.clone().view(layers, -1, kv_heads, head_dim)
    expected_keys[case.layer_index, slots] = case.key
    expected_values[case.layer_index, slots] = case.value
    # Written slots hold k/v; every other slot of every layer (NaN poison included) is unchanged.
    torch.testing.assert_close(
        key_cache.view_as(expected_keys), expected_keys, rtol=0, atol=0, equal_nan=True
    )
    torch.testing.assert_close(
        value_cache.view_as(expected_values), expected_values, rtol=0, atol=0, equal_nan=True
    )


def test_unread_slots_never_influence_output(paged_case):
    """Swap the poison of every slot the call must not read (NaN -> huge values): same output."""
    case = paged_case(MIXED_GROUPS, block_size=3, seed=7)
    out_nan = run_layer(TorchPagedAttention(), case)
    assert torch.isfinite(out_nan).all()
    for cache in (case.kv_cache.key_cache, case.kv_cache.value_cache):
        unread = torch.isnan(cache)  # after the call: everything not written nor history
        cache[unread] = 1e4
    case.kv_cache.key_cache[: case.layer_index] = 3e3  # other layers' history too
    out_huge = run_layer(TorchPagedAttention(), case)
    torch.testing.assert_close(out_huge, out_nan, rtol=0, atol=0)


def test_one_binding_serves_several_layers(paged_case, reference):
    case = paged_case(MIXED_GROUPS, block_size=4, seed=11)
    attention = TorchPagedAttention().bind(case.kv_cache, case.batch)
    gen = torch.Generator().manual_seed(1)
    other_key = torch.randn(case.key.shape, generator=gen)
    other_value = torch.randn(case.value.shape, generator=gen)
    out0 = attention(0, case.query, case.key, case.value)
    out2 = attention(2, case.query, other_key, other_value)
    torch.testing.assert_close(out0.double(), reference(case, 0), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(
        out2.double(), reference(case, 2, other_key, other_value), rtol=1e-5, atol=2e-6
    )
    # Layer 1 was never called: untouched, its new positions still NaN.
    torch.testing.assert_close(
        case.kv_cache.key_cache[1], case.key_cache_before[1], rtol=0, atol=0, equal_nan=True
    )


def test_empty_call_returns_empty_output(paged_case):
    case = paged_case([(0, 0)], block_size=4)
    out = run_layer(TorchPagedAttention(), case)
    assert out.shape == (0, 4, 8)


def test_shape_errors_are_reported_on_bind(paged_case):
    case = paged_case(MIXED_GROUPS, block_size=4)
    too_few_pages = type(case.batch)(
        case.batch.query_start,
        case.batch.context_lengths,
        case.batch.block_tables[:, :2],
        case.batch.write_slots,
        case.batch.max_query_len,
        case.batch.max_context_len,
    )
    with pytest.raises(ValueError, match="block_tables has 2 pages"):
        TorchPagedAttention().bind(case.kv_cache, too_few_pages)
    every_other_block = KVCacheTensors(
        case.kv_cache.key_cache[:, ::2], case.kv_cache.value_cache[:, ::2]
    )
    with pytest.raises(ValueError, match="viewable"):
        TorchPagedAttention().bind(every_other_block, case.batch)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_bidirectional_groups_see_their_whole_context(paged_case, reference, batch_invariant):
    """`causal=False` (a prefix-LM prompt): every query of a group reads all of its context."""
    import dataclasses

    case = paged_case([(5, 5), (3, 11), (1, 4)], block_size=4, seed=7)
    case.batch = dataclasses.replace(case.batch, causal=False)
    out = case.run(TorchPagedAttention(batch_invariant=batch_invariant))
    expected = reference(case, causal=False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.double(), reference(case), atol=1e-3)  # the mask matters
