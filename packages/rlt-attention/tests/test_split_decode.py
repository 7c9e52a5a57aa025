"""Split-KV ("flash-decoding") Triton kernels of decode-only calls vs the torch backend and the
fp64 reference.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1): cases
are small, fp32 and fp16 only (the interpreter's bf16 is not faithful). The tests marked `cuda`
cover bf16, the Ouro shape, no host sync and CUDA-graph replay with rewritten metadata.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rlt_attention import (
    TorchPagedAttention,
    TritonPagedAttention,
    split_config,
    split_decode_kernel,
    triton_kernel,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Decode rows (q_len 1) with mixed contexts, a padding-like row of context 1, an empty group.
DECODE_GROUPS = [(1, 1), (1, 2), (1, 17), (1, 40), (1, 100), (0, 0), (1, 33)]


def assert_same_cache(case, other) -> None:
    """Both cases' caches hold exactly the same values (NaN where nothing was written)."""
    for name in ("key_cache", "value_cache"):
        torch.testing.assert_close(
            getattr(case.kv_cache, name),
            getattr(other.kv_cache, name),
            rtol=0,
            atol=0,
            equal_nan=True,
        )


@pytest.fixture
def launches(monkeypatch):
    """Records which read kernel each layer call launched ("split" with its config, or "tiled")."""
    calls = []
    split_launch = split_decode_kernel.launch_split_decode_attention
    tiled_launch = triton_kernel.launch_paged_attention

    def spy_split(*args, split: split_config.SplitConfig, **kwargs):
        calls.append(("split", split))
        return split_launch(*args, split=split, **kwargs)

    def spy_tiled(*args, **kwargs):
        calls.append(("tiled", None))
        return tiled_launch(*args, **kwargs)

    monkeypatch.setattr(split_decode_kernel, "launch_split_decode_attention", spy_split)
    monkeypatch.setattr(triton_kernel, "launch_paged_attention", spy_tiled)
    return calls


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "num_splits", "block_n"),
    [
        (4, 2, 2, 16, 1, 16),  # G = 1 (one valid row of the 16-row tile), one split: direct output
        (4, 2, 2, 16, 3, 16),
        (3, 2, 2, 12, 8, 16),  # non-power-of-two head dim, more splits than some contexts need
        (16, 6, 2, 16, 3, 16),  # G = 3
        (1, 4, 1, 16, 8, 16),  # G = 4, block size 1
        (5, 4, 2, 32, 1, None),  # default key step (64)
        (16, 4, 1, 16, None, None),  # G = 4, split count from the heuristic
    ],
)
def test_split_decode_matches_torch_backend_and_reference(
    paged_case,
    reference,
    launches,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    num_splits,
    block_n,
):
    kwargs = dict(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=block_size + head_dim,
        device=DEVICE,
    )
    triton_case = paged_case(DECODE_GROUPS, **kwargs)
    torch_case = paged_case(DECODE_GROUPS, **kwargs)
    backend = TritonPagedAttention(num_splits=num_splits, block_n=block_n, fused_decode=True)
    out = triton_case.run(backend)
    assert [kind for kind, _ in launches] == ["split"]
    # The fused merge leaves every ticket at zero for the next call (or graph replay).
    assert all(int(t.abs().sum()) == 0 for t in backend._tickets.values())
    if num_splits is not None:
        assert launches[0][1].num_splits == num_splits
    expected = torch_case.run(TorchPagedAttention())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double().cpu(), reference(triton_case), rtol=1e-5, atol=1e-5)
    # Same cache writes as the torch backend (stored by the split kernel itself).
    assert_same_cache(triton_case, torch_case)


@pytest.mark.parametrize("fusion", ["fused_decode", "store_in_split"])
def test_unfused_decode_store_and_combine_agree(paged_case, launches, monkeypatch, fusion):
    """fused_decode=True (store and merge inside the split kernel) and store_in_split=True
    (the store only) compute the same thing as the default separate store and combine
    kernels."""
    shapes = dict(block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=9, device=DEVICE)
    fused_case, plain_case = (
        paged_case(DECODE_GROUPS, **shapes),
        paged_case(DECODE_GROUPS, **shapes),
    )
    stores, store_launch = [], triton_kernel.launch_store_kv
    monkeypatch.setattr(
        triton_kernel, "launch_store_kv", lambda *a, **k: stores.append(1) or store_launch(*a, **k)
    )
    fused = fused_case.run(TritonPagedAttention(num_splits=3, block_n=16, **{fusion: True}))
    assert [kind for kind, _ in launches] == ["split"] and stores == []
    plain = plain_case.run(TritonPagedAttention(num_splits=3, block_n=16))
    assert stores == [1]
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    assert_same_cache(fused_case, plain_case)


def test_split_counts_agree(paged_case):
    """1, 3 and 8 splits give the same output up to fp32 rounding of the combine."""
    outs = []
    for num_splits in (1, 3, 8):
        case = paged_case(
            DECODE_GROUPS,
            block_size=4,
            num_heads=2,
            num_kv_heads=1,
            head_dim=16,
            seed=3,
            device=DEVICE,
        )
        outs.append(case.run(TritonPagedAttention(num_splits=num_splits, block_n=16)))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=1e-6)


def test_split_decode_fp16(paged_case, reference):
    case = paged_case(
        DECODE_GROUPS, block_size=4, head_dim=16, dtype=torch.float16, seed=4, device=DEVICE
    )
    out = case.run(TritonPagedAttention(num_splits=3, block_n=16))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double().cpu(), reference(case), rtol=2e-3, atol=2e-3)


def test_full_width_bind_with_rewritten_metadata(paged_case, reference):
    """As in a decode CUDA graph: bound once with full-width tables (max_context_len = table
    width), then contexts, tables and slots are rewritten in place; ranges come from the device."""
    shapes = dict(block_size=4, head_dim=16, num_blocks=80, max_pages=30, device=DEVICE)
    first = paged_case([(1, 9), (1, 100), (1, 1)], seed=5, **shapes)
    second = paged_case([(1, 117), (1, 3), (1, 50)], seed=6, **shapes)
    full_width = dataclasses.replace(first.batch, max_context_len=30 * 4)
    attention = TritonPagedAttention(num_splits=8, block_n=16).bind(first.kv_cache, full_width)
    out = attention(first.layer_index, first.query, first.key, first.value)
    torch.testing.assert_close(out.double().cpu(), reference(first), rtol=1e-5, atol=1e-5)

    first.kv_cache.key_cache.copy_(second.kv_cache.key_cache)
    first.kv_cache.value_cache.copy_(second.kv_cache.value_cache)
    for name in ("query_start", "context_lengths", "block_tables", "write_slots"):
        getattr(first.batch, name).copy_(getattr(second.batch, name))
    out = attention(second.layer_index, second.query, second.key, second.value)
    torch.testing.assert_close(out.double().cpu(), reference(second), rtol=1e-5, atol=1e-5)


def test_long_prefill_chunks_keep_the_tiled_kernel(paged_case, launches):
    """Groups of more queries than a split tile holds (q x G > 16) use the tiled kernel; so
    does everything with split_kv=False."""
    case = paged_case([(1, 9), (17, 30), (1, 1)], block_size=4, head_dim=16, device=DEVICE)
    case.run(TritonPagedAttention())
    grouped = paged_case(
        [(9, 12), (1, 3)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, device=DEVICE
    )
    grouped.run(TritonPagedAttention())  # 9 queries x G = 2: 18 tile rows
    decode = paged_case([(1, 9), (1, 12)], block_size=4, head_dim=16, device=DEVICE)
    decode.run(TritonPagedAttention(split_kv=False))
    assert [kind for kind, _ in launches] == ["tiled", "tiled", "tiled"]


# Groups of a few queries (a speculative round's verify pass), decode rows, an empty group.
FEW_QUERY_GROUPS = [(5, 40), (1, 9), (3, 3), (0, 0), (8, 100), (2, 17)]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_splits"),
    [(2, 2, 1), (2, 2, 3), (4, 2, 8), (2, 2, None)],  # G = 1 (8 queries) and G = 2 (16 rows)
)
def test_few_query_groups_use_split_kv_and_match_the_torch_backend(
    paged_case, reference, launches, num_heads, num_kv_heads, num_splits
):
    """Each of a group's queries sees the keys up to its own position (causal), also in splits
    that end before it (their partials are empty for that query)."""
    shapes = dict(
        block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, seed=11
    )
    triton_case = paged_case(FEW_QUERY_GROUPS, device=DEVICE, **shapes)
    torch_case = paged_case(FEW_QUERY_GROUPS, device=DEVICE, **shapes)
    out = triton_case.run(TritonPagedAttention(num_splits=num_splits, block_n=16))
    assert [kind for kind, _ in launches] == ["split"]
    assert launches[0][1].block_m == 16
    expected = torch_case.run(TorchPagedAttention())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double().cpu(), reference(triton_case), rtol=1e-5, atol=1e-5)


def test_choose_splits_heuristic():
    def config(groups, kv_heads, context, **kwargs):
        return split_config.choose_splits(
            num_groups=groups,
            num_kv_heads=kv_heads,
            max_context_len=context,
            queries_per_kv=1,
            head_dim=128,
            **kwargs,
        )

    def splits(groups, kv_heads, context, **kwargs):
        return config(groups, kv_heads, context, **kwargs).num_splits

    # Ouro-1.4B decode (16 kv heads, 132 SMs). 1-4 rows: a small grid, ~6 programs per SM in
    # short splits; 1 row: 16-key steps, 2 warps; 3-4 rows: 32-key steps, 4 warps.
    assert splits(1, 16, 1088) == 50  # ceil(792 / 16)
    one_row = config(1, 16, 1088)
    assert (one_row.block_n, one_row.num_warps, one_row.num_stages) == (16, 2, 2)
    four_rows = config(4, 16, 8192)
    assert (four_rows.num_splits, four_rows.block_n, four_rows.num_warps) == (13, 32, 4)
    assert splits(1, 16, 400) == 25  # at most one 16-key step per split
    # 5+ rows: ceil(2 * 132 / programs) splits of 64-key steps, 4 warps, 3 stages
    eight_rows = config(8, 16, 8192)
    assert (eight_rows.num_splits, eight_rows.block_n, eight_rows.num_stages) == (3, 64, 3)
    assert splits(32, 16, 1088) == 1  # 512 programs already fill the GPU
    assert splits(1, 1, 100_000) == split_config.MAX_SPLITS
    assert splits(1, 16, 16) == 1  # one key step: nothing to split
    assert splits(1, 16, 1088, num_splits=5) == 5
    assert splits(1, 16, 1088, sm_count=78) == 30  # ceil(6 * 78 / 16)
    assert splits(1, 16, 1088, block_n=64) == 17  # at most one 64-key step per split
    assert (
        split_config.choose_splits(
            num_groups=1, num_kv_heads=2, max_context_len=64, queries_per_kv=4, head_dim=12
        ).block_m
        == 16
    )
    # an fp8 cache: the large grid takes the fp8 key step, the small grid keeps its own
    step = split_config._fp8_step
    fp8 = config(32, 16, 1088, kv_fp8=True)
    assert (fp8.block_n, fp8.num_warps, fp8.num_stages, fp8.product) == step
    assert config(1, 16, 1088, kv_fp8=True) == one_row
    with pytest.raises(ValueError, match="num_splits"):
        TritonPagedAttention(num_splits=0)


# ---------------------------------------------------------------------------------------------
# GPU only

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LONG_DECODE = [(1, 1088), (1, 1), (1, 300), (1, 2049), (1, 17)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(16, 16, 16, 128), (16, 16, 4, 64), (5, 8, 2, 96), (32, 4, 2, 256)],
)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_split_decode_matches_torch_on_gpu(
    paged_case, dtype, block_size, num_heads, num_kv_heads, head_dim, num_splits
):
    kwargs = dict(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )
    triton_case, torch_case = paged_case(LONG_DECODE, **kwargs), paged_case(LONG_DECODE, **kwargs)
    out = triton_case.run(TritonPagedAttention(num_splits=num_splits))
    expected = torch_case.run(TorchPagedAttention())
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.cuda
def test_split_decode_does_not_sync(paged_case):
    case = paged_case(
        LONG_DECODE,
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device="cuda",
    )
    backend = TritonPagedAttention()
    case.assert_calls_do_not_sync(backend)


@pytest.mark.cuda
def test_split_decode_replays_in_a_cuda_graph(paged_case):
    """Capture a decode call bound with full-width tables, rewrite everything in place, replay."""
    shapes = dict(
        block_size=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        dtype=torch.bfloat16,
        num_blocks=200,
        max_pages=80,
        device="cuda",
    )
    captured = paged_case([(1, 40), (1, 1088), (1, 1)], seed=1, **shapes)
    replayed = paged_case([(1, 1200), (1, 7), (1, 333)], seed=2, **shapes)
    full = dataclasses.replace(captured.batch, max_context_len=80 * 16)
    attention = TritonPagedAttention().bind(captured.kv_cache, full)
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

    replayed_full = dataclasses.replace(replayed.batch, max_context_len=80 * 16)
    expected = TritonPagedAttention().bind(replayed.kv_cache, replayed_full)(
        replayed.layer_index, replayed.query, replayed.key, replayed.value
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reference = replayed.run(TorchPagedAttention())
    torch.testing.assert_close(out.float(), reference.float(), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("store_in_split", [False, True], ids=["store_kernel", "store_in_split"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_splits"), [(2, 2, 1), (2, 2, 3), (6, 2, 3)]
)
def test_keys_as_rows_products_match_the_torch_backend(
    paged_case, reference, monkeypatch, store_in_split, num_heads, num_kv_heads, num_splits
):
    """The split kernel computing K q^T and V^T p^T (keys as the tile's rows) gives the same
    attention as the rows-by-keys products, one split (direct output) or several."""
    choose = split_config.choose_splits
    monkeypatch.setattr(
        split_config,
        "choose_splits",
        lambda **kw: dataclasses.replace(choose(**kw), product="keys_by_rows"),
    )
    shapes = dict(block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16)
    case = paged_case(DECODE_GROUPS, seed=11, device=DEVICE, **shapes)
    torch_case = paged_case(DECODE_GROUPS, seed=11, device=DEVICE, **shapes)
    backend = TritonPagedAttention(num_splits=num_splits, block_n=16, store_in_split=store_in_split)
    out = case.run(backend)
    expected = torch_case.run(TorchPagedAttention())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double().cpu(), reference(case), rtol=1e-5, atol=1e-5)
    assert_same_cache(case, torch_case)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vector_products_match_the_torch_backend(
    paged_case, reference, monkeypatch, num_splits, dtype
):
    """The CUDA-core split kernel (one row per (group, kv head): multiply-and-sum over the head
    dim) gives the attention of the tensor-core kernel, one split or several; with G = 2 it is
    not eligible and choose_splits keeps keys by rows."""
    choose = split_config.choose_splits
    monkeypatch.setattr(
        split_config,
        "choose_splits",
        lambda **kw: dataclasses.replace(choose(**kw), product="vector"),
    )
    shapes = dict(block_size=4, num_heads=2, num_kv_heads=2, head_dim=16, dtype=dtype)
    case = paged_case(DECODE_GROUPS, seed=13, device=DEVICE, **shapes)
    torch_case = paged_case(DECODE_GROUPS, seed=13, device=DEVICE, **shapes)
    out = case.run(TritonPagedAttention(num_splits=num_splits, block_n=16))
    expected = torch_case.run(TorchPagedAttention())
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert_same_cache(case, torch_case)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), reference(case), rtol=1e-5, atol=1e-5)
    grouped = paged_case(
        DECODE_GROUPS,
        seed=13,
        device=DEVICE,
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    with pytest.raises(ValueError, match="vector product needs one query row"):
        grouped.run(TritonPagedAttention(num_splits=num_splits, block_n=16))


def test_a_vector_step_applies_only_to_one_row_tiles(monkeypatch):
    """RLT_FP8_SPLIT_DECODE's product 2 (vector) is taken where a tile holds one row and no
    store or merge runs in the kernel; elsewhere the fp8 cache keeps keys by rows."""
    monkeypatch.setattr(split_config, "_fp8_step", (32, 2, 2, "vector"))
    kwargs = dict(num_kv_heads=16, max_context_len=1088, head_dim=128, kv_fp8=True)
    assert split_config.choose_splits(num_groups=32, queries_per_kv=1, **kwargs).product == "vector"
    grouped = split_config.choose_splits(num_groups=32, queries_per_kv=2, **kwargs)
    assert grouped.product == "keys_by_rows"
    stores = split_config.choose_splits(
        num_groups=32, queries_per_kv=1, stores_in_kernel=True, **kwargs
    )
    assert stores.product == "keys_by_rows"
    monkeypatch.setenv(split_config.FP8_SPLIT_ENV, "32,2,2,2")
    assert split_config._large_grid_step(split_config.FP8_SPLIT_ENV, None)[3] == "vector"
    monkeypatch.setenv(split_config.FP8_SPLIT_ENV, "32,2,2,3")
    with pytest.raises(ValueError, match="RLT_FP8_SPLIT_DECODE"):
        split_config._large_grid_step(split_config.FP8_SPLIT_ENV, None)
    with pytest.raises(ValueError, match="product must be one of"):
        dataclasses.replace(stores, product="columns")
