"""`Sampler.sample`: greedy, filters and ties, stream determinism, batch independence, dtypes."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import SamplingParams, SamplingRow
from rlt_sampling import Sampler, SamplingBatch, mask_top_k_top_p


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    output = Sampler().sample(logits, SamplingBatch.build(rows, device=logits.device))
    assert output.token_ids.dtype == torch.int64 and output.token_ids.device == logits.device
    return output.token_ids.tolist()


def stream(params: SamplingParams, logits_row: torch.Tensor, counters: range) -> list[int]:
    """Tokens of one request at `counters`, sampled as one batch of identical logits rows."""
    logits = logits_row.expand(len(counters), -1)
    return sample_tokens(logits, [SamplingRow(params, counter) for counter in counters])


def test_greedy_is_argmax_and_ignores_seed_and_counter():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(seed=seed), seed * 7) for seed in range(6)]
    assert sample_tokens(logits, rows) == logits.argmax(dim=-1).tolist()
    reseeded = [SamplingRow(SamplingParams(seed=seed + 100), 1) for seed in range(6)]
    assert sample_tokens(logits, reseeded) == logits.argmax(dim=-1).tolist()


def test_greedy_ties_pick_the_first_index():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]])
    assert sample_tokens(logits, [SamplingRow(SamplingParams(), 0)] * 2) == [1, 0]


def test_top_k_one_equals_greedy_even_on_ties():
    logits = torch.tensor([0.0, 5.0, 5.0, 1.0, 5.0])
    params = SamplingParams(temperature=3.0, top_k=1, seed=11)
    assert set(stream(params, logits, range(200))) == {1}


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids():
    # Tokens 1, 2, 3 tie for the largest logit; k = 2 keeps exactly two of them: ids 1 and 2.
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    filtered = mask_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(filtered).tolist() == [[False, True, True, False, False]]
    params = SamplingParams(temperature=1.0, top_k=2, seed=3)
    assert set(stream(params, logits[0], range(400))) == {1, 2}


@pytest.mark.parametrize("top_k", [-1, 0, 5, 6, 1000])
def test_top_k_disabled_or_at_least_vocab_keeps_everything(top_k):
    logits = torch.randn(1, 5)
    filtered = mask_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([1.0]))
    assert torch.equal(filtered, logits)


def test_tiny_top_p_keeps_exactly_the_argmax():
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0, 2.0 - 1e-4])
    filtered = mask_top_k_top_p(logits[None], torch.tensor([-1]), torch.tensor([1e-9]))
    assert torch.isfinite(filtered).tolist() == [[False, True, False, False, False]]
    params = SamplingParams(temperature=5.0, top_p=1e-6, seed=8)
    assert set(stream(params, logits, range(200))) == {1}


def test_top_p_stops_at_the_first_prefix_reaching_p_and_drops_later_ties():
    # Probabilities 0.4, 0.2, 0.2, 0.2 (tokens 0..3). p = 0.55: ranks 0 and 1 reach 0.6, so the
    # tied tokens 2 and 3 are dropped; p = 0.65 needs one more: token 2, the lower tied id.
    # (p exactly 0.6 is avoided: there fp32 rounding of the cumulative sum decides.)
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    for top_p, kept in ((0.55, [True, True, False, False]), (0.65, [True, True, True, False])):
        filtered = mask_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([top_p]))
        assert torch.isfinite(filtered)[0].tolist() == kept


def test_same_seed_and_counter_repeat_and_counters_form_a_stream():
    logits = torch.zeros(64)  # uniform: every draw is decided by the noise alone
    params = SamplingParams(temperature=1.0, seed=42)
    first = stream(params, logits, range(64))
    assert stream(params, logits, range(64)) == first
    assert len(set(first)) > 32  # 64 uniform draws of 64 tokens: ~41 distinct expected
    assert stream(SamplingParams(temperature=1.0, seed=43), logits, range(64)) != first


def test_resuming_at_a_counter_continues_the_same_stream():
    # A preempted request restarts with a fresh Sampler and batch; only the counter is carried.
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=77)
    uninterrupted = stream(params, logits, range(10))
    assert stream(params, logits, range(4)) + stream(params, logits, range(4, 10)) == uninterrupted


def test_rows_are_independent_of_batch_composition_and_order():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=generator)
    rows = [
        SamplingRow(SamplingParams(temperature=0.8, seed=1), 0),
        SamplingRow(SamplingParams(), 4),
        SamplingRow(SamplingParams(temperature=1.3, top_k=10, seed=1), 0),
        SamplingRow(SamplingParams(temperature=0.5, top_p=0.8, seed=2**50, logprobs=3), 9),
        SamplingRow(SamplingParams(temperature=2.0, top_k=50, top_p=0.5, seed=5), 123),
        SamplingRow(SamplingParams(temperature=1.0, seed=1), 1),
    ]
    alone = [sample_tokens(logits[i : i + 1], [rows[i]])[0] for i in range(len(rows))]
    assert sample_tokens(logits, rows) == alone
    for permutation_seed in range(3):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(permutation_seed))
        permuted = sample_tokens(logits[order], [rows[i] for i in order.tolist()])
        assert permuted == [alone[i] for i in order.tolist()]


def test_mixed_greedy_and_random_rows():
    logits = torch.zeros(4, 1000)
    logits[:, 17] = 0.5  # greedy picks 17; random rows at T = 1 almost never do
    rows = [SamplingRow(SamplingParams(temperature=t, seed=9), 0) for t in (0.0, 1.0, 0.0, 1.0)]
    tokens = sample_tokens(logits, rows)
    assert tokens[0] == tokens[2] == 17
    assert tokens[1] == tokens[3] == sample_tokens(logits[:1], rows[1:2])[0] != 17


def test_rows_may_be_passed_directly_as_in_the_token_sampler_protocol():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(6))
    rows = [SamplingRow(SamplingParams(temperature=0.9, top_p=0.8, seed=s), s) for s in range(3)]
    direct = Sampler().sample(logits, rows)
    assert torch.equal(
        direct.token_ids, Sampler().sample(logits, SamplingBatch.build(rows, "cpu")).token_ids
    )
    assert [host.token_id for host in direct.to_host()] == direct.token_ids.tolist()
