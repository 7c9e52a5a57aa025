"""The flash-attn adapter: against the torch backend on CUDA with the real flash-attn (skipped
where it is not importable or there is no GPU), and on any machine against a stand-in module that
implements flash-attn 2's documented semantics in torch (paged KV through block_table, causal
mask aligned to the bottom right) and rejects what flash_api.cpp rejects, so the adapter's
arguments are checked without the library.

On the GPU: tools/build_flash_attn.sh builds flash-attn from its sdist and runs this file.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from rlt_attention import FlashAttnBackend, TorchPagedAttention
from rlt_attention.flash_attn_backend import _probe_flash_attn, flash_attn_unavailable_reason

BLOCK = 256
# Decode rows and prefill chunks (first and continuing; queries are a context's last q_len
# positions) across page boundaries, in one call.
MIXED = [(1, 300), (64, 64), (37, 250), (100, 560), (1, 1), (200, 1100), (1, 257)]
PREFILL = [(300, 300), (256, 512), (1, 700), (17, 17)]
DECODE = [(1, 1088), (1, 17), (1, 300), (1, 256), (1, 257), (1, 1), (1, 513)]
# flash-attn rounds softmax probabilities to the input dtype before P @ V; the torch backend
# keeps them in fp32 (as in test_cuda_backends.py).
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def compare(paged_case, backend, groups, *, dtype, device, window=None, **shape):
    kwargs = dict(block_size=BLOCK, dtype=dtype, device=device, **shape)
    flash_case, torch_case = paged_case(groups, **kwargs), paged_case(groups, **kwargs)

    def run(case, attention_backend):
        attention = attention_backend.bind(case.kv_cache, case.batch)
        return attention(case.layer_index, case.query, case.key, case.value, window=window)

    out = run(flash_case, backend)
    expected = run(torch_case, TorchPagedAttention())
    assert out.dtype == dtype and out.shape == expected.shape and torch.isfinite(out).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    for name in ("key_cache", "value_cache"):
        torch.testing.assert_close(
            getattr(flash_case.kv_cache, name),
            getattr(torch_case.kv_cache, name),
            rtol=0,
            atol=0,
            equal_nan=True,
        )


# ---------------------------------------------------------------------------------------------
# CUDA, the real flash-attn

needs_flash_attn = pytest.mark.skipif(
    flash_attn_unavailable_reason() is not None,
    reason=f"flash_attn backend unavailable: {flash_attn_unavailable_reason()} "
    "(tools/build_flash_attn.sh builds it on a GPU machine)",
)


@pytest.mark.cuda
@needs_flash_attn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("groups", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_flash_attn_matches_torch_on_gpu(paged_case, dtype, heads, groups):
    num_heads, num_kv_heads = heads
    compare(
        paged_case,
        FlashAttnBackend(),
        groups,
        dtype=dtype,
        device="cuda",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=128,
    )


@pytest.mark.cuda
@needs_flash_attn
@pytest.mark.parametrize("window", [1, 100, 700])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("groups", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_flash_attn_sliding_window_matches_torch_on_gpu(paged_case, window, heads, groups):
    """window_size=(W - 1, 0): the torch backend's window (itself checked against a dense
    reference in test_sliding_window.py)."""
    compare(
        paged_case,
        FlashAttnBackend(),
        groups,
        dtype=torch.bfloat16,
        device="cuda",
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=128,
        window=window,
    )


@pytest.mark.cuda
@needs_flash_attn
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_flash_attn_forced_decode_splits_on_gpu(paged_case, num_splits):
    compare(
        paged_case,
        FlashAttnBackend(num_splits=num_splits),
        DECODE,
        dtype=torch.bfloat16,
        device="cuda",
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
    )


@pytest.mark.cuda
@needs_flash_attn
@pytest.mark.parametrize("groups", [MIXED, DECODE], ids=["mixed", "decode"])
def test_flash_attn_bind_and_layer_calls_do_not_sync(paged_case, groups):
    case = paged_case(
        groups,
        block_size=BLOCK,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    backend = FlashAttnBackend()
    case.assert_calls_do_not_sync(backend)


# ---------------------------------------------------------------------------------------------
# Any machine: a stand-in flash_attn module


def _check_paged(q, k_cache, v_cache, block_table, batch_size):
    """What flash_api.cpp checks of a paged call (the subset this adapter can get wrong)."""
    assert q.dtype in (torch.float16, torch.bfloat16)
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    for tensor in (q, k_cache, v_cache):
        assert tensor.stride(-1) == 1
    assert block_table is not None and block_table.dtype == torch.int32
    assert block_table.stride(-1) == 1 and block_table.shape[0] == batch_size
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert q.shape[-2] % k_cache.shape[2] == 0


def _attend(q, k_cache, v_cache, table_row, seqlen_k, scale, causal, window_size=(-1, -1)):
    """One batch element: q [Lq, H, D] over the first seqlen_k keys of its pages.
    window_size (left, right), as flash-attn documents it: query i sees keys j in
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] (a side < 0: unbounded)."""
    page = k_cache.shape[1]
    positions = torch.arange(seqlen_k, device=q.device)
    blocks = table_row.long()[positions // page]
    k = k_cache[blocks, positions % page].float()  # [Lk, Hkv, D]
    v = v_cache[blocks, positions % page].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:  # bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
        seqlen_q = q.shape[0]
        limit = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
        scores = scores.masked_fill(positions[None, :] > limit, float("-inf"))
    left, right = window_size
    aligned = torch.arange(q.shape[0], device=q.device)[:, None] + seqlen_k - q.shape[0]
    if left >= 0:
        scores = scores.masked_fill(positions[None, :] < aligned - left, float("-inf"))
    if right >= 0:
        scores = scores.masked_fill(positions[None, :] > aligned + right, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).float()  # rounded, as flash-attn does
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class FakeFlashAttn(types.ModuleType):
    """flash-attn 2.8's two paged-KV entry points, same signatures, in plain torch."""

    def __init__(self):
        super().__init__("flash_attn")
        self.calls = []
        self.windows = []  # window_size of every call

        def flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            return_attn_probs=False,
            block_table=None,
        ):
            self.calls.append("varlen")
            self.windows.append(window_size)
            batch = cu_seqlens_q.numel() - 1
            _check_paged(q, k, v, block_table, batch)
            for cu in (cu_seqlens_q, cu_seqlens_k):
                assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.numel() == batch + 1
            assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
            out = torch.empty_like(q)
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            for b in range(batch):
                q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
                seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
                assert q1 - q0 <= max_seqlen_q and seqlen_k <= max_seqlen_k
                out[q0:q1] = _attend(
                    q[q0:q1], k, v, block_table[b], seqlen_k, scale, causal, window_size
                )
            return out

        def flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k=None,
            v=None,
            rotary_cos=None,
            rotary_sin=None,
            cache_seqlens=None,
            cache_batch_idx=None,
            cache_leftpad=None,
            block_table=None,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            rotary_interleaved=True,
            alibi_slopes=None,
            num_splits=0,
            return_softmax_lse=False,
        ):
            self.calls.append("kvcache")
            self.windows.append(window_size)
            assert q.dim() == 4 and k is None and v is None
            batch, seqlen_q = q.shape[:2]
            _check_paged(q, k_cache, v_cache, block_table, batch)
            assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()
            assert cache_seqlens.shape == (batch,) and num_splits >= 0
            max_seqlen_k = block_table.shape[1] * k_cache.shape[1]
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            out = torch.empty_like(q)
            for b in range(batch):
                seqlen_k = int(cache_seqlens[b])
                assert seqlen_k <= max_seqlen_k
                out[b] = _attend(
                    q[b], k_cache, v_cache, block_table[b], seqlen_k, scale, causal, window_size
                )
            return out

        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.flash_attn_with_kvcache = flash_attn_with_kvcache


@pytest.fixture
def fake_flash_attn(monkeypatch):
    fake = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    _probe_flash_attn.cache_clear()
    try:
        yield fake
    finally:
        monkeypatch.undo()
        _probe_flash_attn.cache_clear()


@pytest.mark.parametrize(
    ("groups", "path"),
    [(MIXED, "varlen"), (PREFILL, "varlen"), (DECODE, "kvcache")],
    ids=["mixed", "prefill", "decode"],
)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_adapter_against_a_stand_in_flash_attn(paged_case, fake_flash_attn, groups, path, heads):
    assert flash_attn_unavailable_reason() is None
    compare(
        paged_case,
        FlashAttnBackend(),
        groups,
        dtype=torch.bfloat16,
        device="cpu",
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
    )
    assert set(fake_flash_attn.calls) == {path}


@pytest.mark.parametrize(
    ("groups", "path"),
    [(MIXED, "varlen"), (DECODE, "kvcache")],
    ids=["mixed", "decode"],
)
@pytest.mark.parametrize("window", [1, 100, 300])
def test_adapter_passes_a_window_as_window_size(paged_case, fake_flash_attn, groups, path, window):
    """window W -> window_size=(W - 1, 0) in both entry points (the stand-in applies it as
    flash-attn documents); equal to the torch backend's window. Without a window, or with one
    that hides nothing (>= the call's longest context), no window_size is passed."""
    compare(
        paged_case,
        FlashAttnBackend(),
        groups,
        dtype=torch.bfloat16,
        device="cpu",
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        window=window,
    )
    assert set(fake_flash_attn.calls) == {path}
    assert fake_flash_attn.windows == [(window - 1, 0)]
    for unwindowed in (None, 1100):
        compare(
            paged_case,
            FlashAttnBackend(),
            groups,
            dtype=torch.bfloat16,
            device="cpu",
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            window=unwindowed,
        )
    assert fake_flash_attn.windows[1:] == [(-1, -1), (-1, -1)]


def test_adapter_passes_only_the_table_columns_it_reads(paged_case, fake_flash_attn):
    """A decode table wider than the context (as the runner's graphs bind them) is cut to the
    pages read: flash-attn sizes its KV splits by the table's width."""
    case = paged_case(
        [(1, 300), (1, 20)], block_size=BLOCK, dtype=torch.bfloat16, max_pages=8, head_dim=16
    )
    seen = []
    real = fake_flash_attn.flash_attn_with_kvcache

    @functools.wraps(real)  # the probe reads the signature through __wrapped__
    def spy(*args, **kwargs):
        seen.append(kwargs["block_table"].shape)
        return real(*args, **kwargs)

    fake_flash_attn.flash_attn_with_kvcache = spy
    _probe_flash_attn.cache_clear()
    case.run(FlashAttnBackend())
    assert seen == [(2, 2)]


def test_probe_names_a_missing_paged_argument(fake_flash_attn):
    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None):
        raise AssertionError("not called")

    fake_flash_attn.flash_attn_with_kvcache = flash_attn_with_kvcache
    _probe_flash_attn.cache_clear()
    reason = flash_attn_unavailable_reason()
    assert reason is not None and "flash_attn_with_kvcache takes no block_table" in reason
    with pytest.raises(RuntimeError, match="block_table"):
        FlashAttnBackend()


def test_block_size_not_a_multiple_of_256_is_refused(paged_case, fake_flash_attn):
    case = paged_case([(3, 40)], block_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="divisible by 256"):
        FlashAttnBackend().bind(case.kv_cache, case.batch)
