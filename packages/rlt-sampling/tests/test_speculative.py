"""Drafting and verifying (speculative decoding): greedy acceptance is exact prefix matching;
random rows' emitted tokens follow the TARGET distribution whatever the draft distribution
(rejection sampling), measured over 100,000 independent rows; rows that draft nothing emit
exactly what the plain sampler draws.

Statistics as in test_distribution.py: each token count is Binomial(n, p), |z| < 4.5 per token.
"""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import SamplingMode
from rlt_sampling import Sampler

NUM_ROWS = 100_000
MAX_Z_SCORE = 4.5
TARGET = torch.tensor([2.0, 1.5, 1.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAFT = torch.tensor([0.0, 2.5, -1.0, 1.0, 1.5, 0.0, -2.0, 0.5, 1.0])  # quite unlike TARGET
VOCAB = TARGET.numel()


def rows(n: int, *, temperature: float, seed0: int = 11, counter: int = 0, top_k: int = -1):
    return dict(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.ones(n),
        seed=torch.arange(seed0, seed0 + n, dtype=torch.int64),
        counter=torch.full((n,), counter, dtype=torch.int64),
    )


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    n = counts.sum()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was emitted"
    p = probs[kept].double()
    z = (counts[kept] - n * p) / torch.sqrt(n * p * (1 - p))
    assert float(z.abs().max()) < MAX_Z_SCORE, (counts / n, probs)


def test_greedy_rows_accept_the_longest_matching_prefix_then_the_target_argmax():
    sampler = Sampler()
    targets = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6], [7, 7, 7, 7]])  # argmax per position
    logits = torch.full((3, 4, 10), -5.0)
    logits.scatter_(2, targets[:, :, None], 5.0)
    drafts = torch.tensor([[3, 1, 0], [0, 9, 2], [7, 7, 7]])
    result = sampler.verify_rows(
        logits.view(12, 10),
        draft_tokens=drafts,
        draft_probabilities=None,
        drafted=torch.tensor([3, 3, 2]),
        mode=SamplingMode(),
        **rows(3, temperature=0.0),
    )
    # row 0: drafts 3, 1 match, 0 != 4 -> 2 accepted, then the target's 4
    # row 1: the first draft differs -> 0 accepted, the target's 5
    # row 2: all match but only 2 were drafted -> 2 accepted, then the target's 7
    assert result.accepted.tolist() == [2, 0, 2]
    assert result.token_ids[0, :3].tolist() == [3, 1, 4]
    assert result.token_ids[1, 0].item() == 5
    assert result.token_ids[2, :3].tolist() == [7, 7, 7]


def test_random_drafts_follow_the_draft_distribution():
    proposal = Sampler().propose_rows(
        DRAFT.expand(NUM_ROWS, -1),
        mode=SamplingMode(random=True),
        **rows(NUM_ROWS, temperature=0.8),
    )
    assert_follows(proposal.token_ids, torch.softmax(DRAFT / 0.8, dim=0))
    assert torch.allclose(proposal.probabilities[0], torch.softmax(DRAFT / 0.8, dim=0))


@pytest.mark.parametrize("top_k", [-1, 4])
def test_emitted_tokens_follow_the_target_distribution_whatever_the_draft(top_k):
    sampler = Sampler()
    mode = SamplingMode(random=True, filtered=top_k > 0)
    settings = rows(NUM_ROWS, temperature=0.9, top_k=top_k)
    proposal = sampler.propose_rows(DRAFT.expand(NUM_ROWS, -1), mode=mode, **settings)
    second = sampler.propose_rows(
        DRAFT.flip(0).expand(NUM_ROWS, -1),
        mode=mode,
        **{**settings, "counter": settings["counter"] + 1},
    )
    drafts = torch.stack([proposal.token_ids, second.token_ids], dim=1)
    q = torch.stack([proposal.probabilities, second.probabilities], dim=1)
    target = torch.stack([TARGET, TARGET.flip(0) * 0.5, TARGET], dim=0)  # 3 positions
    result = sampler.verify_rows(
        target.expand(NUM_ROWS, 3, VOCAB).reshape(-1, VOCAB),
        draft_tokens=drafts,
        draft_probabilities=q,
        drafted=torch.full((NUM_ROWS,), 2),
        mode=mode,
        **settings,
    )
    for position in range(3):
        emitted = result.accepted >= position
        # position i's token given the earlier ones (independent targets here) follows p_i
        probs = torch.softmax(_filtered(target[position] / 0.9, top_k), dim=0)
        assert_follows(result.token_ids[emitted, position], probs)
    # drafts this unlike the target are often rejected, and often accepted
    assert 0.2 < (result.accepted > 0).float().mean() < 0.9


def test_a_row_that_drafts_nothing_emits_what_the_plain_sampler_draws():
    sampler = Sampler()
    n = 64
    settings = rows(n, temperature=1.1, counter=5)
    logits = torch.randn(n, 2, VOCAB, generator=torch.Generator().manual_seed(0))
    mode = SamplingMode(random=True, top_logprobs=3)
    result = sampler.verify_rows(
        logits.reshape(-1, VOCAB),
        draft_tokens=torch.zeros(n, 1, dtype=torch.int64),
        draft_probabilities=torch.full((n, 1, VOCAB), 1.0 / VOCAB),
        drafted=torch.zeros(n, dtype=torch.int64),
        mode=mode,
        **settings,
    )
    plain = sampler.sample_rows(logits[:, 0], mode=mode, **settings)
    assert result.accepted.eq(0).all()
    assert torch.equal(result.token_ids[:, 0], plain.token_ids)
    assert torch.equal(result.logprobs[:, 0], plain.logprobs)
    assert torch.equal(result.top_token_ids[:, 0], plain.top_token_ids)


def test_logprobs_are_those_of_the_raw_target_logits_for_the_emitted_tokens():
    sampler = Sampler()
    n = 32
    logits = torch.randn(n * 3, VOCAB, generator=torch.Generator().manual_seed(1))
    drafts = torch.randint(0, VOCAB, (n, 2), generator=torch.Generator().manual_seed(2))
    q = torch.softmax(torch.randn(n, 2, VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    mode = SamplingMode(random=True, top_logprobs=2)
    result = sampler.verify_rows(
        logits,
        draft_tokens=drafts,
        draft_probabilities=q,
        drafted=torch.full((n,), 2),
        mode=mode,
        **rows(n, temperature=1.0),
    )
    expected = torch.log_softmax(logits, dim=-1).view(n, 3, VOCAB)
    chosen = expected.gather(2, result.token_ids[:, :, None]).squeeze(2)
    assert torch.equal(result.logprobs, chosen)
    assert torch.equal(result.top_logprobs, expected.topk(2, dim=-1).values)


def test_an_accepted_count_override_replays_drafts_then_the_target_token():
    sampler = Sampler()
    logits = torch.zeros(2 * 4, VOCAB)
    logits[:, 6] = 3.0  # the target always says 6
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    result = sampler.verify_rows(
        logits,
        draft_tokens=drafts,
        draft_probabilities=None,
        drafted=torch.tensor([3, 1]),
        mode=SamplingMode(),
        accepted_override=torch.tensor([2, 3]),
        **rows(2, temperature=0.0),
    )
    assert result.accepted.tolist() == [2, 1]  # never more than drafted
    assert result.token_ids[0, :3].tolist() == [1, 2, 6]
    assert result.token_ids[1, :2].tolist() == [4, 6]


def _filtered(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0:
        return logits
    kept = logits.topk(top_k).indices
    out = torch.full_like(logits, float("-inf"))
    out[kept] = logits[kept]
    return out
