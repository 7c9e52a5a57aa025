"""Empirical token frequencies over many counters match the intended distributions.

Method: one request (fixed seed) is sampled at counters 0..n-1 in a single batch, n = 100,000.
Each token's count is Binomial(n, p_v), so z_v = (count_v - n p_v) / sqrt(n p_v (1 - p_v)) is
~N(0, 1). We require |z_v| < 4.5 for every token (two-sided p ~ 7e-6 each, < 1e-4 for the whole
test file), i.e. a max absolute frequency error of at most 4.5 * 0.5 / sqrt(n) ~ 0.007. Tokens
the filters remove must never appear (count exactly 0). The noise is deterministic, so these
tests are reproducible; the thresholds only say that a correct sampler fails them with
negligible probability over the choice of seed.
"""

from __future__ import annotations

import math

import pytest
import torch
from rlt_contracts import SamplingParams, SamplingRow
from rlt_sampling import Sampler, SamplingBatch

NUM_DRAWS = 100_000
MAX_Z_SCORE = 4.5
LOGITS = torch.tensor([2.0, 1.5, 1.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def empirical_counts(params: SamplingParams) -> torch.Tensor:
    rows = [SamplingRow(params, counter) for counter in range(NUM_DRAWS)]
    logits = LOGITS.expand(NUM_DRAWS, -1)
    tokens = Sampler().sample(logits, SamplingBatch.build(rows, device="cpu")).token_ids
    return torch.bincount(tokens, minlength=LOGITS.numel()).double()


def assert_matches(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    assert math.isclose(float(expected_probs.sum()), 1.0, rel_tol=1e-12)
    removed = expected_probs == 0
    assert counts[removed].sum() == 0, "a filtered-out token was sampled"
    kept_probs = expected_probs[~removed]
    z_scores = (counts[~removed] - NUM_DRAWS * kept_probs) / torch.sqrt(
        NUM_DRAWS * kept_probs * (1 - kept_probs)
    )
    assert float(z_scores.abs().max()) < MAX_Z_SCORE, (counts / NUM_DRAWS, expected_probs)


def reference_probs(temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """softmax(LOGITS / T) in fp64, renormalised over top-k, then over the top-p nucleus."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=0)
    order = torch.sort(probs, descending=True, stable=True).indices
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[: top_k if top_k > 0 else len(order)]] = True
    probs = torch.where(kept, probs, 0.0) / probs[kept].sum()
    mass_before = 0.0
    for token in order.tolist():
        kept[token] = kept[token] and mass_before < top_p
        mass_before += float(probs[token])
    return torch.where(kept, probs, 0.0) / probs[kept].sum()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_frequencies_match_softmax_of_scaled_logits(temperature):
    counts = empirical_counts(SamplingParams(temperature=temperature, seed=1234))
    assert_matches(counts, reference_probs(temperature))


def test_frequencies_match_renormalised_top_k():
    counts = empirical_counts(SamplingParams(temperature=0.8, top_k=3, seed=99))
    expected = reference_probs(0.8, top_k=3)
    assert int((expected > 0).sum()) == 3
    assert_matches(counts, expected)


def test_frequencies_match_renormalised_top_p():
    # At T = 1.2 the sorted masses are 0.310, 0.204, 0.135, 0.135, 0.089, ... (cumulative 0.310,
    # 0.514, 0.649, 0.784): p = 0.7 keeps the first four tokens, far from either boundary.
    counts = empirical_counts(SamplingParams(temperature=1.2, top_p=0.7, seed=5))
    expected = reference_probs(1.2, top_p=0.7)
    assert int((expected > 0).sum()) == 4
    assert_matches(counts, expected)


def test_frequencies_match_top_k_then_top_p():
    # top-k = 5 first, then the nucleus of the 5 renormalised tokens at T = 1.0: masses 0.390,
    # 0.236, 0.143, 0.143, 0.087 (cumulative 0.390, 0.626, 0.770, 0.913), so p = 0.85 keeps four.
    # Without the renormalisation (cumulative 0.352, 0.566, 0.695, 0.825) it would keep five.
    counts = empirical_counts(SamplingParams(temperature=1.0, top_k=5, top_p=0.85, seed=17))
    expected = reference_probs(1.0, top_k=5, top_p=0.85)
    assert int((expected > 0).sum()) == 4 and int((reference_probs(1.0, top_p=0.85) > 0).sum()) == 5
    assert_matches(counts, expected)
