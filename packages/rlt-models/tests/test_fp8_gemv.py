"""The persistent fp8 GEMV (rlt_models.fp8_gemv) computes the dequantized weight's product for
every config (ragged N, K not a multiple of the chunk, several tiles per program), honours the
`needed` flag, is a candidate of the fp8 selector at one row only and survives the
kernel-choice cache (Triton interpreter on CPU; on CUDA also its inline-PTX widening, its
default grid and CUDA-graph capture)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from rlt_models import fp8_gemv as g
from rlt_models import fp8_linear as fl
from rlt_models import kernel_choice_cache as cache
from rlt_models import small_batch_linear as sbl
from rlt_models.fp8 import quantize_per_channel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    sbl.triton is None or (DEVICE == "cpu" and not sbl.INTERPRETED),
    reason="needs CUDA, or TRITON_INTERPRET=1 before import",
)
# small configs covering 1, 2 and 3 K chunks, 2 and 3 buffered tiles
SMALL = (g.GemvConfig(2, 64, 1, 2), g.GemvConfig(4, 32, 2, 3), g.GemvConfig(8, 128, 4, 2))


def _case(n: int, k: int, seed: int, dtype=torch.float16):
    generator = torch.Generator().manual_seed(seed)
    data, scale = quantize_per_channel(torch.randn(n, k, generator=generator) * 0.05)
    x = torch.randn(1, k, generator=generator).to(dtype)
    reference = F.linear(x.float(), data.float() * scale[:, None])
    return x.to(DEVICE), data.to(DEVICE), scale.to(DEVICE), reference.to(DEVICE)


def _close(out: torch.Tensor, reference: torch.Tensor) -> bool:
    # e4m3 widens exactly; fp32 accumulation, one rounding to fp16/bf16
    return torch.allclose(out.float(), reference, rtol=1e-2, atol=1e-2 * reference.abs().max())


@needs_kernels
@pytest.mark.parametrize("config", SMALL, ids=str)
@pytest.mark.parametrize(
    ("n", "k", "programs"), [(13, 96, 2), (16, 64, 3), (7, 36, 1), (29, 64, 1)]
)
def test_persistent_gemv_matches_the_dequantized_product(config, n, k, programs):
    if not g.eligible(torch.empty(n, k, dtype=torch.uint8), config):
        pytest.skip("K beyond 3 chunks of this config")
    x, data, scale, reference = _case(n, k, n * k + programs)
    out = g.launch_persistent(x, data, scale, config, programs=programs)
    assert out.dtype == x.dtype and out.shape == (1, n)
    assert _close(out, reference)


@needs_kernels
def test_persistent_gemv_honours_the_needed_flag_and_bf16():
    x, data, scale, reference = _case(21, 72, 5, torch.bfloat16)
    config = SMALL[1]
    plain = g.launch_persistent(x, data, scale, config, programs=2)
    assert _close(plain, reference)
    flag = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(g.launch_persistent(x, data, scale, config, flag, programs=2), plain)
    flag.zero_()
    skipped = g.launch_persistent(x, data, scale, config, flag, programs=2)
    assert skipped.shape == plain.shape and not skipped.any()


def test_eligibility_and_candidates_at_one_row_only(monkeypatch):
    monkeypatch.setattr(fl, "_capability", lambda device: (9, 0))  # no device asked on the CPU
    data = torch.zeros(64, 2048, dtype=torch.uint8)
    assert g.eligible(data, g.GemvConfig(2, 1024, 1)) and g.eligible(data, g.CONFIGS[0])
    assert not g.eligible(data, g.GemvConfig(2, 512, 1))  # 4 chunks
    assert not g.eligible(torch.zeros(64, 2046, dtype=torch.uint8), g.CONFIGS[0])  # K % 4
    fp8 = data.to(torch.float8_e4m3fn)
    persistent = {
        choice.tile
        for choice in fl.Fp8Linear.candidates(1, fp8, torch.bfloat16)
        if choice.kind == fl.WEIGHT_ONLY_PERSISTENT
    }
    assert persistent == set(g.CONFIGS)
    for rows in (2, 16):
        kinds = {choice.kind for choice in fl.Fp8Linear.candidates(rows, fp8, torch.bfloat16)}
        assert fl.WEIGHT_ONLY_PERSISTENT not in kinds
    # a choice restored from the kernel-choice cache (a TileConfig) maps back to its config
    for config in g.CONFIGS:
        restored = fl.Fp8Choice(fl.WEIGHT_ONLY_PERSISTENT, sbl.TileConfig(**asdict(config)))
        assert restored == fl.Fp8Choice(fl.WEIGHT_ONLY_PERSISTENT, config)


def test_a_persistent_choice_survives_the_kernel_choice_cache(monkeypatch, tmp_path):
    device = torch.device("cpu")
    monkeypatch.setattr(sbl.small_batch_linear, "choices", {})
    monkeypatch.setattr(fl.fp8_linear, "choices", {})
    monkeypatch.setattr(cache, "fingerprint", lambda device: "test")
    monkeypatch.setattr(cache, "_indexed", lambda device: device)
    key = (1, 2048, 5632, torch.bfloat16, device)
    choice = fl.Fp8Choice(fl.WEIGHT_ONLY_PERSISTENT, g.CONFIGS[-1])
    fl.fp8_linear.choices[key] = choice
    cache.save(tmp_path, device)
    fl.fp8_linear.choices.clear()
    assert cache.load(tmp_path, device) == 1
    assert fl.fp8_linear.choices == {key: choice}
    assert isinstance(fl.fp8_linear.choices[key].tile, g.GemvConfig)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", g.CONFIGS, ids=str)
@pytest.mark.parametrize(("n", "k"), [(2048, 2048), (1000, 5632), (6144, 2044)])
def test_every_config_on_cuda_with_its_default_grid(config, n, k):
    x, data, scale, reference = _case(n, k, n + k, torch.bfloat16)
    if not g.eligible(data, config):
        pytest.skip("K beyond 3 chunks of this config")
    for _ in range(2):  # the provisional grid, then the compiled kernel's wave
        assert _close(g.launch_persistent(x, data, scale, config), reference)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_in_a_cuda_graph_without_syncs():
    x, data, scale, _ = _case(2048, 2048, 3, torch.bfloat16)
    config = g.CONFIGS[0]
    g.launch_persistent(x, data, scale, config)  # compiles and sets the grid, outside capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = g.launch_persistent(x, data, scale, config)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _close(out, F.linear(x.float(), data.float() * scale[:, None]))
