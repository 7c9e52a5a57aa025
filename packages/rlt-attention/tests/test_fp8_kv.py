"""An fp8 KV cache (float8_e4m3fn with per-layer scales, `KVCacheTensors.key_scale`/`value_scale`):
every backend that declares `supports_fp8_kv` stores round(x / scale) and attends over
stored * scale, which is exactly the attention over a model-dtype cache holding those
dequantized values; the others are refused at selection.

The comparison is against the torch backend on an fp32 cache that holds the dequantized values
and is given the call's keys/values after the same rounding: the two compute the same function,
so fp32 tolerances apply (the Triton kernels run in the interpreter on the CPU, on CUDA there).
"""

from __future__ import annotations

import pytest
import torch
from rlt_attention import TorchPagedAttention, TritonPagedAttention, select_attention_backend
from rlt_attention.kv_store import FP8, quantize
from rlt_contracts import (
    AttentionRequirements,
    ConfigurationError,
    KVCacheTensors,
    KVLayout,
    PagedAttentionBatch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GROUPS = [(1, 9), (5, 5), (3, 17), (1, 1), (4, 12), (0, 0)]
DECODE_GROUPS = [(1, 9), (1, 40), (1, 1), (1, 23)]


def _scales(cache: torch.Tensor) -> torch.Tensor:
    """Per layer: the power of two at or above max|x| / 448 (NaN slots ignored)."""
    finite = torch.nan_to_num(cache.float(), nan=0.0).abs().flatten(1).amax(dim=1)
    return torch.exp2(torch.ceil(torch.log2(finite / 448)))


def _fp8_pair(case):
    """(fp8 cache, fp32 cache of its dequantized values, rounded key, rounded value)."""
    k_scale, v_scale = _scales(case.kv_cache.key_cache), _scales(case.kv_cache.value_cache)
    shape = (-1, 1, 1, 1, 1)
    key8 = quantize(case.kv_cache.key_cache, k_scale.view(shape))
    value8 = quantize(case.kv_cache.value_cache, v_scale.view(shape))
    fp8 = KVCacheTensors(key8, value8, k_scale, v_scale)
    plain = KVCacheTensors(key8.float() * k_scale.view(shape), value8.float() * v_scale.view(shape))
    layer = case.layer_index
    key = quantize(case.key, k_scale[layer]).float() * k_scale[layer]
    value = quantize(case.value, v_scale[layer]).float() * v_scale[layer]
    return fp8, plain, key, value


def _run(backend, cache: KVCacheTensors, case, key, value) -> torch.Tensor:
    return backend.bind(cache, case.batch)(case.layer_index, case.query, key, value)


@pytest.mark.parametrize(
    "backend",
    [
        TorchPagedAttention(),
        TorchPagedAttention(batch_invariant=True),
        TritonPagedAttention(),
        TritonPagedAttention(split_kv=False),
    ],
    ids=["torch", "torch_invariant", "triton", "triton_prefill_kernel"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_attends_over_the_dequantized_values(paged_case, backend, dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bf16 tl.dot is checked on a GPU (the interpreter's is not meaningful)")
    case = paged_case(GROUPS, block_size=4, head_dim=16, seed=3, device=DEVICE, dtype=dtype)
    fp8, plain, key, value = _fp8_pair(case)
    out = _run(backend, fp8, case, case.key, case.value)
    expected = _run(TorchPagedAttention(), plain, case, key.to(dtype), value.to(dtype))
    assert out.dtype == case.query.dtype and torch.isfinite(out).all()
    # fp32: the same function (summation order); bf16: Triton rounds q and p to fp16 and the
    # output to bf16 (2**-8 relative), the torch backend only the output
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    # the call's keys/values were stored as their e4m3 rounding, nowhere else was written
    stored = plain.key_cache.clone()
    written = fp8.key_cache.float() * fp8.key_scale.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(written, stored, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fused", [False, True], ids=["split_then_combine", "fused_store"])
def test_split_decode_stores_and_reads_the_rounded_own_key(paged_case, fused):
    """Decode rows through the split-KV kernel, with the call's own key/value stored inside it
    (fused) or by the store kernel first: both read them back exactly as stored."""
    case = paged_case(DECODE_GROUPS, block_size=4, head_dim=16, seed=5, device=DEVICE)
    fp8, plain, key, value = _fp8_pair(case)
    backend = TritonPagedAttention(num_splits=3, fused_decode=fused, store_in_split=fused)
    out = _run(backend, fp8, case, case.key, case.value)
    expected = _run(TorchPagedAttention(), plain, case, key, value)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    written = fp8.value_cache.float() * fp8.value_scale.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(written, plain.value_cache, rtol=0, atol=0, equal_nan=True)


def test_saturation_and_scale_checks():
    scale = torch.tensor(0.5)
    x = torch.tensor([1000.0, -1000.0, 0.3])
    assert quantize(x, scale).float().tolist() == [448.0, -448.0, 0.625]  # 0.6 -> e4m3 0.625
    cache = torch.zeros(2, 3, 4, 1, 8, dtype=FP8)
    batch = PagedAttentionBatch(
        query_start=torch.zeros(1, dtype=torch.int32),
        context_lengths=torch.zeros(0, dtype=torch.int32),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        write_slots=torch.zeros(0, dtype=torch.int64),
        max_query_len=0,
        max_context_len=0,
    )
    with pytest.raises(ValueError, match="needs key and value scales"):
        TorchPagedAttention().bind(KVCacheTensors(cache, cache), batch)
    with pytest.raises(ValueError, match=r"one per layer"):
        TorchPagedAttention().bind(
            KVCacheTensors(cache, cache, torch.ones(3), torch.ones(3)), batch
        )


def test_selection_refuses_a_backend_without_fp8_kv():
    requirements = AttentionRequirements(
        device_type="cuda",
        dtype="bfloat16",
        head_dim=128,
        num_heads=16,
        num_kv_heads=16,
        block_size=16,
        kv_layout=KVLayout.LAST_EXITED,
        kv_cache_dtype="fp8",
    )
    with pytest.raises(ConfigurationError, match="fp8 KV cache"):
        select_attention_backend(requirements, "flash_attn")
    assert select_attention_backend(requirements, "auto").name in ("triton", "torch")


@pytest.mark.parametrize("product", ["rows_by_keys", "keys_by_rows", "vector"])
def test_split_decode_products_read_the_fp8_cache_alike(paged_case, monkeypatch, product):
    """Every product of the split kernel attends over the dequantized fp8 values."""
    import dataclasses

    from rlt_attention import split_config

    choose = split_config.choose_splits
    monkeypatch.setattr(
        split_config,
        "choose_splits",
        lambda **kw: dataclasses.replace(choose(**kw), product=product),
    )
    heads = dict(num_heads=2, num_kv_heads=2) if product == "vector" else {}  # one row per tile
    case = paged_case(DECODE_GROUPS, block_size=4, head_dim=16, seed=7, device=DEVICE, **heads)
    fp8, plain, key, value = _fp8_pair(case)
    out = _run(TritonPagedAttention(num_splits=3), fp8, case, case.key, case.value)
    expected = _run(TorchPagedAttention(), plain, case, key, value)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
