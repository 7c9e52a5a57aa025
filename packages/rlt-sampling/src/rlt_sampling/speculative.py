"""Drafting and verifying tokens for self-speculative decoding (the sampler's side of it;
README.md, "Speculative decoding"): `propose` draws one draft per row and keeps the distribution
q it drew from; `verify` accepts drafts (greedy: equal to the target's argmax; random: rejection
sampling) and emits one more token, so every emitted token follows the target distribution.
Each purpose draws from its own counter-based stream (`*_STREAM`, added to the counter's high
word, which no real output index reaches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rlt_contracts import LogitsAdjustments

from rlt_sampling.batch import SamplingBatch
from rlt_sampling.distribution import adjusted_logits, filtered_logits, probabilities
from rlt_sampling.noise import counter_uniform

DRAFT_STREAM = 1 << 40
ACCEPT_STREAM = 2 << 40
RESIDUAL_STREAM = 3 << 40

Noise = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Proposal:
    """token_ids [N] int64; probabilities [N, V] fp32 (None when every row is greedy)."""

    token_ids: torch.Tensor
    probabilities: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Verification:
    """See `rlt_contracts.VerifiedRows`: accepted [n]; token_ids [n, K + 1] (0 .. accepted
    valid); logprob fields of the raw target logits for those tokens, or None."""

    accepted: torch.Tensor
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def propose(logits: torch.Tensor, batch: SamplingBatch, noise: Noise) -> Proposal:
    """One draft per row at output index `batch.counter` from the DRAFT stream."""
    adjusted, greedy_token_ids = adjusted_logits(logits, batch)
    if batch.all_greedy:
        return Proposal(greedy_token_ids, None)
    filtered = filtered_logits(adjusted, batch)
    gumbel = noise(batch.seed, batch.counter + DRAFT_STREAM, logits.shape[-1])
    sampled = gumbel.add_(filtered).argmax(dim=-1)
    token_ids = torch.where(batch.temperature == 0.0, greedy_token_ids, sampled)
    return Proposal(token_ids, probabilities(filtered, greedy_token_ids, batch))


def verify(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    *,
    draft_tokens: torch.Tensor,
    draft_probabilities: torch.Tensor | None,
    drafted: torch.Tensor,
    noise: Noise,
    accepted_override: torch.Tensor | None = None,
) -> Verification:
    """Accept each row's drafts and emit one more token (module doc). target_logits
    [n * (K + 1), V] row-major by (row, position); `batch` describes the n rows at their first
    position (counter = its output index); draft_tokens [n, K]; draft_probabilities [n, K, V]
    (needed unless every row is greedy); drafted [n] int64 in [0, K]."""
    n, num_drafts = draft_tokens.shape
    width = num_drafts + 1
    vocab = target_logits.shape[-1]
    positions = _per_position(batch, width)
    adjusted, greedy_token_ids = adjusted_logits(target_logits, positions)
    random_rows = batch.temperature > 0.0
    offsets = torch.arange(num_drafts, device=drafted.device)
    if batch.all_greedy:
        target = greedy_token_ids.view(n, width)
        accept = draft_tokens == target[:, :num_drafts]
    else:
        if draft_probabilities is None:
            raise ValueError("random rows need the draft probabilities")
        filtered = filtered_logits(adjusted, positions)
        gumbel = noise(positions.seed, positions.counter, vocab)
        sampled = torch.where(
            positions.temperature == 0.0, greedy_token_ids, gumbel.add_(filtered).argmax(dim=-1)
        )
        target = sampled.view(n, width)
        probs = probabilities(filtered, greedy_token_ids, positions).view(n, width, vocab)
        draft_index = draft_tokens[:, :, None]
        p_draft = probs[:, :num_drafts].gather(2, draft_index).squeeze(2)
        q_draft = draft_probabilities.gather(2, draft_index).squeeze(2)
        counters = batch.counter[:, None] + offsets + ACCEPT_STREAM
        uniform = counter_uniform(
            batch.seed.repeat_interleave(num_drafts), counters.reshape(-1), 1
        ).view(n, num_drafts)
        accept = torch.where(
            random_rows[:, None],
            uniform * q_draft < p_draft,
            draft_tokens == target[:, :num_drafts],
        )
    accept &= offsets[None, :] < drafted[:, None]
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    if accepted_override is not None:
        accepted = torch.minimum(accepted_override, drafted)
    final = target.gather(1, accepted[:, None]).squeeze(1)
    if not batch.all_greedy and accepted_override is None:
        final = torch.where(
            random_rows & (accepted < drafted),
            _residual_sample(probs, draft_probabilities, accepted, batch, noise),
            final,
        )
    emitted = torch.cat([draft_tokens, final[:, None]], dim=1)
    columns = torch.arange(width, device=drafted.device)
    emitted = torch.where(columns[None, :] < accepted[:, None], emitted, final[:, None])
    if batch.num_top_logprobs is None:
        return Verification(accepted, emitted, None, None, None)
    logprobs = torch.log_softmax(target_logits.to(torch.float32), dim=-1)
    chosen = logprobs.gather(1, emitted.reshape(-1, 1)).view(n, width)
    top_logprobs, top_token_ids = torch.topk(logprobs, k=min(batch.num_top_logprobs, vocab), dim=-1)
    return Verification(
        accepted,
        emitted,
        chosen,
        top_token_ids.view(n, width, -1),
        top_logprobs.view(n, width, -1),
    )


def _residual_sample(
    probs: torch.Tensor,
    draft_probabilities: torch.Tensor,
    accepted: torch.Tensor,
    batch: SamplingBatch,
    noise: Noise,
) -> torch.Tensor:
    """[n] draw from norm(max(p_a - q_a, 0)) at each row's first rejected position a (where
    a == K the value is unused). If rounding left the residual all zero (p_a == q_a), p_a."""
    n, width, vocab = probs.shape
    at = accepted.view(n, 1, 1).expand(n, 1, vocab)
    p_at = probs.gather(1, at).squeeze(1)
    q_at = draft_probabilities.gather(1, at.clamp(max=width - 2)).squeeze(1)
    residual = (p_at - q_at).clamp_(min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    gumbel = noise(batch.seed, batch.counter + accepted + RESIDUAL_STREAM, vocab)
    return gumbel.add_(residual.log()).argmax(dim=-1)


def _per_position(batch: SamplingBatch, width: int) -> SamplingBatch:
    """The batch of n rows repeated for their `width` positions (row-major), position i at
    output index counter + i; the logprob request is dropped (verify computes its own)."""

    def repeat(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.repeat_interleave(width, dim=0)

    offsets = torch.arange(width, device=batch.counter.device)
    adjustments = batch.adjustments
    if adjustments is not None:
        fields = dataclasses.fields(adjustments)
        adjustments = LogitsAdjustments(
            **{f.name: repeat(getattr(adjustments, f.name)) for f in fields}
        )
    return dataclasses.replace(
        batch,
        temperature=repeat(batch.temperature),
        top_k=repeat(batch.top_k),
        top_p=repeat(batch.top_p),
        seed=repeat(batch.seed),
        counter=(batch.counter[:, None] + offsets).reshape(-1),
        min_p=repeat(batch.min_p),
        adjustments=adjustments,
        num_top_logprobs=None,
        requested_logprobs=(None,) * (batch.num_rows * width),
    )
