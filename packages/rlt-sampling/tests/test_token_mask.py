"""Structured output's allowed-token bitmask on the logits (CPU)."""

from __future__ import annotations

import torch
from rlt_contracts import LogitsAdjustments, SamplingMode
from rlt_sampling import Sampler
from rlt_sampling.token_mask import apply_token_bitmask_, bitmask_words


def bitmask(allowed_rows: list[set[int] | None], vocab: int) -> torch.Tensor:
    """int32 [N, words] with the given tokens allowed (None: every token)."""
    words = [[0] * bitmask_words(vocab) for _ in allowed_rows]
    for row, allowed in enumerate(allowed_rows):
        for token in range(vocab) if allowed is None else allowed:
            words[row][token // 32] |= 1 << (token % 32)
    signed = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words]
    return torch.tensor(signed, dtype=torch.int32)


def test_disallowed_tokens_become_minus_infinity_and_the_rest_is_untouched():
    vocab = 70  # three words, the last one partly used
    logits = torch.randn(3, vocab)
    mask = bitmask([{0, 31, 32, 63, 69}, None, {5}], vocab)
    masked = apply_token_bitmask_(logits.clone(), mask)
    for row, allowed in enumerate([{0, 31, 32, 63, 69}, set(range(vocab)), {5}]):
        for token in range(vocab):
            if token in allowed:
                assert masked[row, token] == logits[row, token]
            else:
                assert masked[row, token] == float("-inf")


def test_greedy_and_random_rows_sample_only_allowed_tokens_and_logprobs_stay_raw():
    vocab, rows = 300, 4
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 5
    allowed = [{3}, {10, 200, 299}, None, {150, 151}]
    mask = bitmask(allowed, vocab)
    sampler = Sampler()
    for temperature in (0.0, 1.5):
        for counter in range(5):
            out = sampler.sample_rows(
                logits,
                temperature=torch.full((rows,), temperature),
                top_k=torch.full((rows,), -1, dtype=torch.int64),
                top_p=torch.ones(rows),
                seed=torch.arange(rows, dtype=torch.int64),
                counter=torch.full((rows,), counter, dtype=torch.int64),
                mode=SamplingMode(random=temperature > 0, top_logprobs=2, constrained=True),
                adjustments=LogitsAdjustments(token_bitmask=mask),
            )
            for row, tokens in enumerate(allowed):
                token = int(out.token_ids[row])
                assert tokens is None or token in tokens
            free = int(out.token_ids[2])
            if temperature == 0:
                assert free == int(logits[2].argmax())
            raw = torch.log_softmax(logits, dim=-1)
            assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
