"""Counter-based noise: exact hash emulation, strict (0, 1) range, uniformity, independence."""

from __future__ import annotations

import math
import random

import pytest
import torch
from rlt_sampling.noise import (
    MASK32,
    SEED_DOMAIN,
    TOKEN_DOMAIN,
    counter_gumbel,
    counter_uniform,
    lowbias32,
    row_keys,
)


def lowbias32_reference(word: int) -> int:
    """Wellons' lowbias32 on Python ints (arbitrary precision, masked to 32 bits)."""
    word ^= word >> 16
    word = (word * 0x7FEB352D) & MASK32
    word ^= word >> 15
    word = (word * 0x846CA68B) & MASK32
    word ^= word >> 16
    return word


def reference_uniform(seed: int, counter: int, token_id: int) -> float:
    """The documented formula (noise.py docstring, README worked example) on Python ints."""
    key = lowbias32_reference((seed & MASK32) ^ SEED_DOMAIN)
    key = lowbias32_reference(key ^ (((seed >> 32) ^ (counter >> 32)) & MASK32))
    key = lowbias32_reference(key ^ (counter & MASK32))
    bits = lowbias32_reference(key ^ lowbias32_reference(token_id ^ TOKEN_DOMAIN))
    return ((bits >> 8) | 1) / 2**24


def wilson_hilferty_chi2_quantile(degrees: int, z_score: float) -> float:
    """Upper chi-square quantile for `degrees` (accurate to <1% for degrees >= 30)."""
    scale = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - scale + z_score * math.sqrt(scale)) ** 3


def test_lowbias32_matches_reference_without_overflow():
    rng = random.Random(0)
    words = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, MASK32] + [
        rng.randrange(2**32) for _ in range(5000)
    ]
    hashed = lowbias32(torch.tensor(words, dtype=torch.int64))
    assert hashed.tolist() == [lowbias32_reference(w) for w in words]
    assert int(hashed.min()) >= 0 and int(hashed.max()) <= MASK32


def test_uniform_follows_the_documented_formula():
    seeds, counters = [0, 42, 2**32 + 7, 2**63 - 1], [0, 1, 3, 2**32 + 5]
    uniforms = counter_uniform(torch.tensor(seeds), torch.tensor(counters), vocab_size=70_000)
    for row, (seed, counter) in enumerate(zip(seeds, counters, strict=True)):
        for token_id in (0, 1, 65_535, 65_536, 69_999):
            assert uniforms[row, token_id].item() == reference_uniform(seed, counter, token_id)


def test_lowbias32_does_not_modify_its_input():
    words = torch.arange(10, dtype=torch.int64)
    lowbias32(words)
    assert words.tolist() == list(range(10))


def test_one_seed_never_maps_two_counters_to_one_key():
    counters = torch.arange(200_000, dtype=torch.int64)
    keys = row_keys(torch.full_like(counters, 12345), counters)
    assert torch.unique(keys).numel() == counters.numel()


def test_uniform_is_strictly_inside_unit_interval_at_extreme_inputs():
    seeds = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1] * 4, dtype=torch.int64)
    counters = torch.tensor([0] * 5 + [1] * 5 + [2**32 - 1] * 5 + [2**62] * 5, dtype=torch.int64)
    uniforms = counter_uniform(seeds, counters, vocab_size=50_000)
    assert uniforms.dtype == torch.float32
    assert bool((uniforms > 0).all()) and bool((uniforms < 1).all())
    assert bool(torch.isfinite(counter_gumbel(seeds, counters, vocab_size=50_000)).all())


def test_uniform_is_a_pure_function_of_seed_counter_and_token():
    seeds = torch.tensor([3, 9, 3, 2**40], dtype=torch.int64)
    counters = torch.tensor([0, 5, 1, 7], dtype=torch.int64)
    together = counter_uniform(seeds, counters, vocab_size=300)
    for row in range(4):
        alone = counter_uniform(seeds[row : row + 1], counters[row : row + 1], vocab_size=300)
        assert torch.equal(alone[0], together[row])
    # A larger vocabulary extends the row without changing its first 300 values.
    assert torch.equal(counter_uniform(seeds, counters, vocab_size=1000)[:, :300], together)


@pytest.mark.parametrize("varied", ["counter", "seed"])
def test_uniform_is_roughly_uniform_and_uncorrelated(varied):
    # 256 rows (consecutive counters of one seed, or consecutive seeds at one counter) x 4096
    # tokens = 1,048,576 draws. Thresholds are ~4.75 sigma (one-sided p ~ 1e-6 per check), so a
    # failure means a real defect, not bad luck.
    num_rows, vocab_size = 256, 4096
    consecutive = torch.arange(num_rows, dtype=torch.int64)
    constant = torch.full((num_rows,), 2024, dtype=torch.int64)
    seeds, counters = (constant, consecutive) if varied == "counter" else (consecutive, constant)
    uniforms = counter_uniform(seeds, counters, vocab_size).double()
    draws = uniforms.numel()
    assert abs(uniforms.mean().item() - 0.5) < 4.75 * math.sqrt(1 / 12 / draws)

    num_bins = 64
    counts = torch.histc(uniforms, bins=num_bins, min=0.0, max=1.0)
    expected = draws / num_bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < wilson_hilferty_chi2_quantile(num_bins - 1, z_score=4.75)

    centered = uniforms - 0.5
    for neighbours in (centered[1:] * centered[:-1], centered[:, 1:] * centered[:, :-1]):
        correlation = neighbours.mean().item() / (1 / 12)
        assert abs(correlation) < 4.75 / math.sqrt(neighbours.numel())  # adjacent rows / tokens
