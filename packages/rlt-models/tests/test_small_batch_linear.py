"""The small-batch linear kernel computes x @ W.T (Triton interpreter on CPU, fp16), masks
every edge (rows < 16, N and K not multiples of the tiles), and the selector falls back to
torch wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rlt_models import small_batch_linear as sbl

pytestmark = pytest.mark.skipif(sbl.triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("config", [sbl.CONFIGS[0], sbl.CONFIGS[1], sbl.CONFIGS[6]])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 80), (3, 33, 300), (16, 64, 256)])
def test_kernel_matches_the_fp32_product(config, rows, n, k):
    if config.single_row and rows != 1:
        pytest.skip("the single-row kernel takes one row")
    if DEVICE == "cpu" and not sbl.INTERPRETED:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 before import")
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).half().to(DEVICE)
    w = torch.randn(n, k, generator=generator).half().to(DEVICE)
    out = sbl.launch(x, w, config)
    reference = F.linear(x.float(), w.float())
    assert out.dtype == torch.float16 and out.shape == (rows, n)
    # fp32 accumulation of fp16 products, one rounding to fp16 (relative 2**-11)
    assert torch.allclose(out.float(), reference, rtol=2e-3, atol=2e-3 * k**0.5)


@pytest.mark.parametrize("config", [sbl.CONFIGS[0], sbl.CONFIGS[6]], ids=["tile", "single_row"])
def test_needed_flag_skips_the_product(config):
    """`needed` = 1: the same product as without the flag; 0: zeros (no weight is read)."""
    if DEVICE == "cpu" and not sbl.INTERPRETED:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 before import")
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, 96, generator=generator).half().to(DEVICE)
    w = torch.randn(40, 96, generator=generator).half().to(DEVICE)
    plain = sbl.launch(x, w, config)
    flag = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(sbl.launch(x, w, config, flag), plain)
    flag.zero_()
    skipped = sbl.launch(x, w, config, flag)
    assert skipped.shape == plain.shape and not skipped.any()


def test_selector_keeps_torch_where_the_kernel_does_not_apply():
    linear = sbl.SmallBatchLinear()
    x = torch.randn(2, 8)
    w = torch.randn(4, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))  # fp32 / CPU: plain torch, not measured
    assert linear.choices == {}
    assert not sbl.SmallBatchLinear._eligible(torch.randn(17, 8).half(), w.half())


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_selection_times_cold_weights_and_keeps_the_product(rows):
    """On CUDA the first call measures cuBLAS and every config over weight copies that exceed
    twice the L2 (as a loop sees them), remembers the choice, and returns the same product."""
    torch.manual_seed(rows)
    w = (torch.randn(2048, 2048, device="cuda") * 0.02).bfloat16()
    x = torch.randn(rows, 2048, device="cuda").bfloat16()
    copies = sbl._cold_copies(w)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    assert copies[0] is w
    assert len(copies) == sbl.MAX_COPIES or len(copies) * w.numel() * 2 >= 2 * l2_bytes
    linear = sbl.SmallBatchLinear()
    out = linear(x, w)
    (choice,) = linear.choices.values()
    assert choice is None or choice in sbl.CONFIGS
    reference = F.linear(x.float(), w.float())
    assert torch.allclose(out.float(), reference, rtol=1e-2, atol=1e-2)
    assert torch.equal(linear(x, w), out)  # remembered: the same kernel again
