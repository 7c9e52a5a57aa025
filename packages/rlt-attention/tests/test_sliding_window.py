"""Sliding-window layers (`LayerAttention(..., window=W)`, contracts 0.3.1): the query at position
p sees only the keys at p - W + 1 .. p.

Every backend is checked against a dense fp32 reference written here (each group's keys and
values gathered into one tensor, a [q_len, context] mask, one softmax), on caches whose pages
wholly before each group's first visible key are poisoned: their table entries are -1 and their
slots NaN in every layer, so reading one raises (torch's index_select), reads out of bounds or
puts NaN into the output. The torch backend runs on the CPU, the Triton kernels in Triton's
interpreter there (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA; tiny sizes, fp32):
interpreter runs check the kernels' logic, not their compiled behaviour, speed or bf16, which the
tests marked `cuda` cover. fp32 tolerances: the backends accumulate in fp32 in another order
than the reference (1e-5 covers a few ulps of sums over up to 300 keys).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rlt_attention import (
    BACKENDS,
    FLASH_ATTN_CAPABILITIES,
    TORCH_CAPABILITIES,
    TRITON_CAPABILITIES,
    BackendEntry,
    TorchPagedAttention,
    TritonPagedAttention,
    select_attention_backend,
    split_config,
    split_decode_kernel,
    triton_kernel,
)
from rlt_contracts import (
    AttentionCapabilities,
    AttentionRequirements,
    ConfigurationError,
    KVCacheTensors,
    KVLayout,
    PagedAttentionBatch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Prefill chunks: a first chunk, chunks starting mid-context, a decode row, a one-token
# context, an empty group, in one call.
PREFILL_GROUPS = [(6, 6), (5, 17), (1, 9), (7, 30), (0, 0), (1, 1), (3, 40)]
# Decode rows: contexts from 1 to 257 positions (65 pages of 4), an empty group.
DECODE_GROUPS = [(1, 1), (1, 2), (1, 40), (1, 100), (0, 0), (1, 257)]
# Groups of a few queries (a speculative round's verify pass): the split-KV path.
FEW_QUERY_GROUPS = [(5, 40), (1, 9), (3, 3), (0, 0), (8, 100), (2, 17)]
TOLERANCE = 1e-5


def dense_reference(case, window: int | None) -> torch.Tensor:
    """fp32 [N, H, D]: each group's context gathered densely (history from the cache before
    the call, the call's own keys/values rounded to the cache dtype), the window as a mask."""
    layer = case.layer_index
    _, _, _, kv_heads, head_dim = case.key_cache_before.shape
    cache_dtype = case.key_cache_before.dtype
    keys = case.key_cache_before[layer].reshape(-1, kv_heads, head_dim).float().clone()
    values = case.value_cache_before[layer].reshape(-1, kv_heads, head_dim).float().clone()
    written = case.batch.write_slots.cpu()
    keys[written] = case.key.cpu().to(cache_dtype).float()
    values[written] = case.value.cpu().to(cache_dtype).float()
    query = case.query.cpu().float()
    num_rows, num_heads, _ = query.shape
    out = torch.zeros((num_rows, num_heads, head_dim))
    row = 0
    for g, (q_len, ctx) in enumerate(case.groups):
        if q_len == 0:
            continue
        slots = [case.slot(g, p) for p in range(ctx)]
        group = num_heads // kv_heads
        k = keys[slots].repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = values[slots].repeat_interleave(group, dim=1)
        query_positions = torch.arange(ctx - q_len, ctx)[:, None]
        key_positions = torch.arange(ctx)[None, :]
        visible = key_positions <= query_positions
        if window is not None:
            visible &= query_positions - key_positions < window
        scores = torch.einsum("qhd,khd->hqk", query[row : row + q_len], k) * head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        row += q_len
    return out


def poison_pages_before_windows(case, window: int) -> int:
    """Every page wholly before its group's first visible key (the first query's position
    - window + 1): table entry -1, slots NaN in every layer. Returns the pages poisoned."""
    poisoned = 0
    for g, (q_len, ctx) in enumerate(case.groups):
        first_visible = max(ctx - q_len - window + 1, 0)
        for page in range(first_visible // case.block_size):
            block = case.block_rows[g][page]
            case.kv_cache.key_cache[:, block] = float("nan")
            case.kv_cache.value_cache[:, block] = float("nan")
            case.batch.block_tables[g, page] = -1
            poisoned += 1
    return poisoned


def windowed_call(case, backend, window: int | None) -> torch.Tensor:
    attention = backend.bind(case.kv_cache, case.batch)
    return attention(case.layer_index, case.query, case.key, case.value, window=window)


def check_against_reference(case, backend, window: int, *, poison: bool = True) -> torch.Tensor:
    """The backend's windowed output equals the dense reference with the pages before the
    window poisoned (never read) and is finite."""
    expected = dense_reference(case, window)
    if poison:
        poison_pages_before_windows(case, window)
    out = windowed_call(case, backend, window)
    assert out.shape == case.query.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), expected, rtol=TOLERANCE, atol=TOLERANCE)
    return out


def test_every_backend_declares_sliding_windows():
    for capabilities in (TORCH_CAPABILITIES, TRITON_CAPABILITIES, FLASH_ATTN_CAPABILITIES):
        assert capabilities.supports_sliding_window


def test_poisoning_reaches_pages_that_a_full_context_call_reads(paged_case):
    """The poison is real: the same call without a window reads the poisoned pages."""
    case = paged_case(DECODE_GROUPS, block_size=4, seed=1)
    assert poison_pages_before_windows(case, 7) == 0 + 0 + 8 + 23 + 62
    with pytest.raises((IndexError, RuntimeError)):
        windowed_call(case, TorchPagedAttention(), None)


# ---------------------------------------------------------------------------------------------
# torch backend (CPU)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["padded", "invariant"])
@pytest.mark.parametrize("block_size", [1, 4, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (2, 2)])
@pytest.mark.parametrize("window", [1, 3, 8, 25, 1000])
def test_torch_prefill_chunks_match_the_dense_reference(
    paged_case, batch_invariant, block_size, num_heads, num_kv_heads, window
):
    case = paged_case(
        PREFILL_GROUPS,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=block_size + window,
    )
    check_against_reference(case, TorchPagedAttention(batch_invariant=batch_invariant), window)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["padded", "invariant"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (4, 4)])
@pytest.mark.parametrize("window", [1, 7, 64, 100, 256])
def test_torch_decode_over_many_pages_matches_the_dense_reference(
    paged_case, batch_invariant, num_heads, num_kv_heads, window
):
    case = paged_case(
        DECODE_GROUPS, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=window
    )
    check_against_reference(case, TorchPagedAttention(batch_invariant=batch_invariant), window)


def test_the_window_changes_the_output(paged_case):
    """A window narrower than a context hides keys: the output differs from full attention."""
    case = paged_case(DECODE_GROUPS, block_size=4, seed=2)
    windowed = windowed_call(case, TorchPagedAttention(), 7)
    full = dense_reference(case, None)
    rows = [3, 4]  # contexts 100 and 257
    assert not torch.allclose(windowed[rows], full[rows], atol=1e-3)


def test_one_binding_serves_layers_of_different_windows(paged_case):
    """Layers with and without a window (and two widths) through one bound call: each layer's
    index is its own."""
    case = paged_case(PREFILL_GROUPS, block_size=4, seed=4)
    attention = TorchPagedAttention().bind(case.kv_cache, case.batch)
    for window in (None, 3, 8, 3, None):
        out = attention(case.layer_index, case.query, case.key, case.value, window=window)
        expected = dense_reference(case, window)
        torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)


# ---------------------------------------------------------------------------------------------
# window=None and windows that hide nothing: the unwindowed numbers, bit for bit


def _backends():
    return [
        ("torch", lambda: TorchPagedAttention()),
        ("torch_invariant", lambda: TorchPagedAttention(batch_invariant=True)),
        ("triton", lambda: TritonPagedAttention()),
        ("triton_tiled", lambda: TritonPagedAttention(split_kv=False)),
        ("triton_invariant", lambda: TritonPagedAttention(batch_invariant=True)),
    ]


@pytest.mark.parametrize(
    "make_backend", [b for _, b in _backends()], ids=[n for n, _ in _backends()]
)
@pytest.mark.parametrize("groups", [PREFILL_GROUPS, DECODE_GROUPS], ids=["prefill", "decode"])
def test_window_none_and_windows_past_every_context_are_bit_identical(
    paged_case, make_backend, groups
):
    outs = []
    for window in ("absent", None, 257, 10_000):
        case = paged_case(groups, block_size=4, head_dim=16, seed=5, device=DEVICE)
        attention = make_backend().bind(case.kv_cache, case.batch)
        if window == "absent":
            outs.append(attention(case.layer_index, case.query, case.key, case.value))
        else:
            outs.append(
                attention(case.layer_index, case.query, case.key, case.value, window=window)
            )
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Refused windows


def _all_backends():
    return [make() for _, make in _backends()]


@pytest.mark.parametrize("backend", _all_backends(), ids=[n for n, _ in _backends()])
def test_bidirectional_groups_refuse_a_window_before_writing(paged_case, backend):
    case = paged_case([(5, 5), (3, 11)], block_size=4, head_dim=16, device=DEVICE)
    case.batch = dataclasses.replace(case.batch, causal=False)
    attention = backend.bind(case.kv_cache, case.batch)
    with pytest.raises(ValueError, match="bidirectional groups"):
        attention(case.layer_index, case.query, case.key, case.value, window=4)
    torch.testing.assert_close(
        case.kv_cache.key_cache.cpu(), case.key_cache_before, rtol=0, atol=0, equal_nan=True
    )
    # without a window the same call serves
    attention(case.layer_index, case.query, case.key, case.value)


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_a_window_that_is_not_a_positive_int_is_refused(paged_case, window):
    case = paged_case(PREFILL_GROUPS, block_size=4)
    for backend in (TorchPagedAttention(), TorchPagedAttention(batch_invariant=True)):
        with pytest.raises(ValueError, match="window must be None or an int >= 1"):
            windowed_call(case, backend, window)


# ---------------------------------------------------------------------------------------------
# Triton kernels (the interpreter on the CPU, compiled on CUDA)


@pytest.fixture
def launches(monkeypatch):
    """Which read kernel each layer call launched ("split" with its config, or "tiled")."""
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


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2)])
@pytest.mark.parametrize("window", [1, 5, 16, 29])
def test_triton_prefill_kernel_matches_the_dense_reference(
    paged_case, launches, num_heads, num_kv_heads, window
):
    """16-row tiles hold 8 (G = 2) or 5 (G = 3) queries: a 20-query chunk spans several query
    tiles, each starting its key walk at its own first visible key; 16-key steps."""
    groups = [(20, 41), (1, 23), (9, 9), (6, 30), (0, 0)]
    case = paged_case(
        groups,
        block_size=4,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        seed=window,
        device=DEVICE,
    )
    check_against_reference(case, TritonPagedAttention(block_m=16, block_n=16), window)
    assert [kind for kind, _ in launches] == ["tiled"]


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default_tile", "invariant"])
@pytest.mark.parametrize("window", [1, 8, 30])
def test_triton_prefill_kernel_default_tiles(paged_case, batch_invariant, window):
    backend = TritonPagedAttention(batch_invariant=batch_invariant)
    case = paged_case(PREFILL_GROUPS, block_size=5, head_dim=16, seed=window, device=DEVICE)
    check_against_reference(case, backend, window)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "num_splits"),
    [
        (4, 2, 2, 1),  # G = 1, one split: direct output
        (4, 2, 2, 3),
        (4, 4, 1, 8),  # G = 4, most of the 8 splits hold no visible key for small windows
        (3, 6, 2, None),  # G = 3, the split count from the heuristic (capped by the window)
    ],
)
@pytest.mark.parametrize("window", [1, 7, 33])
def test_triton_split_decode_matches_the_dense_reference(
    paged_case, launches, block_size, num_heads, num_kv_heads, num_splits, window
):
    case = paged_case(
        DECODE_GROUPS,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        seed=window + block_size,
        device=DEVICE,
    )
    check_against_reference(case, TritonPagedAttention(num_splits=num_splits, block_n=16), window)
    assert [kind for kind, _ in launches] == ["split"]
    if num_splits is None:  # chosen for the window's keys, not the 257-key context
        assert launches[0][1].num_splits <= -(-window // 16)


@pytest.mark.parametrize("fusion", ["fused_decode", "store_in_split"])
@pytest.mark.parametrize("window", [1, 9])
def test_triton_split_decode_storing_in_the_kernel(paged_case, launches, fusion, window):
    """The split that covers a row's own position stores it (it is always inside the window);
    fused_decode merges the splits in the last one to finish, empty splits included."""
    case = paged_case(
        DECODE_GROUPS,
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        seed=9,
        device=DEVICE,
    )
    backend = TritonPagedAttention(num_splits=4, block_n=16, **{fusion: True})
    check_against_reference(case, backend, window)
    assert [kind for kind, _ in launches] == ["split"]
    torch.testing.assert_close(  # the call's keys landed at their slots
        case.kv_cache.key_cache[case.layer_index].reshape(-1, 2, 16)[case.batch.write_slots],
        case.key,
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("product", ["keys_by_rows", "vector"])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_triton_split_decode_products(paged_case, monkeypatch, product, num_splits):
    """Keys as the tile's rows, and the CUDA-core vector product (G = 1, one row per tile),
    with a window."""
    choose = split_config.choose_splits
    monkeypatch.setattr(
        split_config,
        "choose_splits",
        lambda **kw: dataclasses.replace(choose(**kw), product=product),
    )
    case = paged_case(
        DECODE_GROUPS,
        block_size=4,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        seed=13,
        device=DEVICE,
    )
    check_against_reference(case, TritonPagedAttention(num_splits=num_splits, block_n=16), 11)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("window", [1, 4, 20])
def test_triton_split_kv_for_a_few_queries_per_group(
    paged_case, launches, num_heads, num_kv_heads, window
):
    """Each of a group's queries has its own window; a split may hold no key of one row."""
    case = paged_case(
        FEW_QUERY_GROUPS,
        block_size=4,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        seed=11,
        device=DEVICE,
    )
    check_against_reference(case, TritonPagedAttention(num_splits=3, block_n=16), window)
    assert [kind for kind, _ in launches] == ["split"]


def test_triton_split_decode_with_a_full_width_bind_and_rewritten_metadata(paged_case):
    """As in a decode CUDA graph: bound once at full table width, then contexts, tables and
    slots rewritten in place; the window's range comes from the device."""
    shapes = dict(block_size=4, head_dim=16, num_blocks=80, max_pages=30, device=DEVICE)
    first = paged_case([(1, 9), (1, 100), (1, 1)], seed=5, **shapes)
    second = paged_case([(1, 117), (1, 3), (1, 50)], seed=6, **shapes)
    full_width = dataclasses.replace(first.batch, max_context_len=30 * 4)
    attention = TritonPagedAttention(num_splits=8, block_n=16).bind(first.kv_cache, full_width)
    out = attention(first.layer_index, first.query, first.key, first.value, window=10)
    torch.testing.assert_close(out.cpu(), dense_reference(first, 10), rtol=1e-5, atol=1e-5)

    first.kv_cache.key_cache.copy_(second.kv_cache.key_cache)
    first.kv_cache.value_cache.copy_(second.kv_cache.value_cache)
    for name in ("query_start", "context_lengths", "block_tables", "write_slots"):
        getattr(first.batch, name).copy_(getattr(second.batch, name))
    out = attention(second.layer_index, second.query, second.key, second.value, window=10)
    torch.testing.assert_close(out.cpu(), dense_reference(second, 10), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Batch-invariant mode: a windowed row is computed as it would be alone


def _sub_call(case, rows: list[int], context_len: int, backend, window: int) -> torch.Tensor:
    """The call of one group of `case`'s query rows `rows` (consecutive positions ending at
    context_len - 1) over case's group 0 table, after case's own call wrote every key."""
    device = case.kv_cache.key_cache.device
    index = torch.tensor(rows, device=device)
    batch = PagedAttentionBatch(
        query_start=torch.tensor([0, len(rows)], dtype=torch.int32, device=device),
        context_lengths=torch.tensor([context_len], dtype=torch.int32, device=device),
        block_tables=case.batch.block_tables[:1],
        write_slots=case.batch.write_slots[index],
        max_query_len=len(rows),
        max_context_len=context_len,
    )
    attention = backend.bind(case.kv_cache, batch)
    return attention(
        case.layer_index, case.query[index], case.key[index], case.value[index], window=window
    )


@pytest.mark.parametrize(
    "make_backend",
    [
        lambda: TorchPagedAttention(batch_invariant=True),
        lambda: TritonPagedAttention(batch_invariant=True),
    ],
    ids=["torch", "triton"],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2)])
def test_invariant_rows_equal_alone_and_in_any_chunk(
    paged_case, make_backend, num_heads, num_kv_heads
):
    """A 14-token chunk at positions 62..75 (window 8): the chunk's first rows start their key
    walk in the step at 0 (window from 55), the row at 75 alone in the step at 64 (window from
    68); torch's 8-row blocks differ likewise. Rows alone, in a 3-row chunk and in the whole
    chunk are bitwise equal; the chunk is also computed among other groups."""
    groups = [(14, 76), (1, 200), (30, 130)]
    case = paged_case(
        groups,
        block_size=4,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        seed=21,
        device=DEVICE,
    )
    backend = make_backend()
    together = windowed_call(case, backend, 8)  # writes every group's keys
    torch.testing.assert_close(
        together.float().cpu(), dense_reference(case, 8), rtol=TOLERANCE, atol=TOLERANCE
    )
    chunk = together[:14]
    torch.testing.assert_close(
        _sub_call(case, list(range(14)), 76, backend, 8), chunk, rtol=0, atol=0
    )
    for i in (0, 7, 13):
        alone = _sub_call(case, [i], 62 + i + 1, backend, 8)
        torch.testing.assert_close(alone, chunk[i : i + 1], rtol=0, atol=0)
    torch.testing.assert_close(
        _sub_call(case, [11, 12, 13], 76, backend, 8), chunk[11:14], rtol=0, atol=0
    )


# ---------------------------------------------------------------------------------------------
# Selection: a sliding window is a hard requirement


def requirements(**overrides) -> AttentionRequirements:
    fields = dict(
        device_type="cpu",
        dtype="float32",
        head_dim=64,
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        kv_layout=KVLayout.LAST_EXITED,
        sliding_window=True,
    )
    return AttentionRequirements(**(fields | overrides))


def test_selection_serves_sliding_windows_with_declaring_backends():
    assert select_attention_backend(requirements()).name == "torch"
    cuda = select_attention_backend(requirements(device_type="cuda", cuda_graphs=True))
    assert cuda.name == "triton" and cuda.cuda_graphs and "sliding window" in cuda.reason


def test_a_backend_without_sliding_windows_is_refused_naming_the_option(monkeypatch):
    fields = {
        name: getattr(TRITON_CAPABILITIES, name) for name in TRITON_CAPABILITIES.__struct_fields__
    }
    no_window = AttentionCapabilities(**(fields | {"supports_sliding_window": False}))
    monkeypatch.setitem(
        BACKENDS,
        "triton",
        BackendEntry("triton", no_window, lambda: None, TritonPagedAttention),
    )
    selection = select_attention_backend(requirements(device_type="cuda"))
    assert selection.name == "torch"
    assert any("sliding_window" in reason for reason in selection.rejected["triton"])
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(requirements(device_type="cuda"), "triton")
    assert info.value.options == ("attention_backend", "model")
    assert "cannot attend within a sliding window (sliding_window" in info.value.message
    # without the requirement the same backend serves
    assert select_attention_backend(
        requirements(device_type="cuda", sliding_window=False)
    ).name == ("triton")


# ---------------------------------------------------------------------------------------------
# GPU only (compiled kernels, bf16, CUDA graphs)

GPU_TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LONG_DECODE = [(1, 1088), (1, 1), (1, 300), (1, 2049), (1, 17), (1, 4100)]
GPU_MIXED = [(1, 300), (1, 17), (64, 64), (1, 129), (37, 250), (100, 160), (1, 1), (9, 1000)]


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "block_size", "num_heads", "num_kv_heads", "head_dim"),
    [
        (torch.bfloat16, 16, 16, 16, 128),
        (torch.bfloat16, 16, 16, 4, 64),
        (torch.bfloat16, 5, 8, 2, 96),
        (torch.float16, 16, 16, 4, 64),
        (torch.float32, 16, 16, 16, 128),
    ],
    ids=["bf16_mha", "bf16_gqa", "bf16_odd", "fp16_gqa", "fp32_mha"],
)
@pytest.mark.parametrize("window", [1, 200, 4096])
@pytest.mark.parametrize("groups", [LONG_DECODE, GPU_MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize(
    "make_backend",
    [
        lambda: TritonPagedAttention(),
        lambda: TritonPagedAttention(num_splits=7),
        lambda: TritonPagedAttention(batch_invariant=True),
        lambda: TorchPagedAttention(),
    ],
    ids=["triton", "triton_7_splits", "triton_invariant", "torch"],
)
def test_windows_match_the_dense_reference_on_gpu(
    paged_case, dtype, block_size, num_heads, num_kv_heads, head_dim, window, groups, make_backend
):
    case = paged_case(
        groups,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )
    expected = dense_reference(case, window)
    poison_pages_before_windows(case, window)
    out = windowed_call(case, make_backend(), window)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = GPU_TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_windowed_calls_do_not_sync(paged_case):
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
    attention = backend.bind(case.kv_cache, case.batch)
    attention(case.layer_index, case.query, case.key, case.value, window=256)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attention = backend.bind(case.kv_cache, case.batch)
        for layer in range(case.kv_cache.key_cache.shape[0]):
            attention(layer, case.query, case.key, case.value, window=256)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_windowed_split_decode_replays_in_a_cuda_graph(paged_case):
    """Capture a windowed decode call bound at full table width, rewrite everything in place,
    replay: equal to an eager call, and to the dense reference."""
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
    attention(captured.layer_index, query, key, value, window=100)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(captured.layer_index, query, key, value, window=100)

    captured.kv_cache.key_cache.copy_(replayed.kv_cache.key_cache)
    captured.kv_cache.value_cache.copy_(replayed.kv_cache.value_cache)
    for name in ("query_start", "context_lengths", "block_tables", "write_slots"):
        getattr(captured.batch, name).copy_(getattr(replayed.batch, name))
    query.copy_(replayed.query), key.copy_(replayed.key), value.copy_(replayed.value)
    graph.replay()

    replayed_full = dataclasses.replace(replayed.batch, max_context_len=80 * 16)
    expected = TritonPagedAttention().bind(replayed.kv_cache, replayed_full)(
        replayed.layer_index, replayed.query, replayed.key, replayed.value, window=100
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reference = dense_reference(replayed, 100)
    torch.testing.assert_close(out.float().cpu(), reference, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.cuda
def test_fp8_cache_with_a_window_on_gpu(paged_case):
    """An fp8 cache (the vector split product at large grids) with a window attends over the
    dequantized values: compared with the torch backend on the same fp8 cache."""
    case = paged_case(
        LONG_DECODE * 8,
        block_size=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    from rlt_attention.kv_store import quantize

    scale = torch.full((case.kv_cache.key_cache.shape[0],), 0.05, device="cuda")
    shape = (-1, 1, 1, 1, 1)
    fp8 = KVCacheTensors(
        quantize(torch.nan_to_num(case.kv_cache.key_cache), scale.view(shape)),
        quantize(torch.nan_to_num(case.kv_cache.value_cache), scale.view(shape)),
        scale,
        scale.clone(),
    )
    outs = []
    for backend in (TritonPagedAttention(), TorchPagedAttention()):
        cache = KVCacheTensors(
            fp8.key_cache.clone(), fp8.value_cache.clone(), fp8.key_scale, fp8.value_scale
        )
        attention = backend.bind(cache, case.batch)
        outs.append(attention(case.layer_index, case.query, case.key, case.value, window=500))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=1.6e-2, atol=1.6e-2)
