"""The distribution a row samples from: adjusted logits, their filtered form, and probabilities.

Shared by `Sampler.sample` (one token per row) and speculative decoding (`speculative.py`,
which needs the whole draft and target distributions), so both follow exactly the same steps:
adjustments (`logits_processing.adjust_logits`), then for random rows temperature, min_p and
top-k / top-p (`filtering`). A greedy row's distribution is a point mass on its argmax.
"""

from __future__ import annotations

import torch

from rlt_sampling.batch import SamplingBatch
from rlt_sampling.filtering import mask_min_p, mask_top_k_top_p
from rlt_sampling.logits_processing import adjust_logits


def adjusted_logits(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits after the adjustments that precede temperature (the raw logits when no row
    adjusts), and every row's greedy choice: their argmax (first index on ties)."""
    adjusted = logits
    if batch.adjustments is not None:
        adjusted = adjust_logits(
            logits, batch.adjustments, counter=batch.counter, mode=batch.adjustment_mode
        )
    return adjusted, adjusted.argmax(dim=-1)


def filtered_logits(adjusted: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 [N, V]: every row as if it were random (greedy rows use T = 1 here): divided by its
    temperature, then min_p, top-k and top-p (removed tokens -inf). softmax of a random row's
    result is the distribution it samples from; Gumbel-max over it samples that exactly."""
    safe_temperature = torch.where(batch.temperature == 0.0, 1.0, batch.temperature)
    scaled_logits = adjusted.to(torch.float32) / safe_temperature[:, None]
    if batch.min_p is not None:
        scaled_logits = mask_min_p(scaled_logits, batch.min_p)
    if batch.any_top_k_top_p:
        scaled_logits = mask_top_k_top_p(scaled_logits, batch.top_k, batch.top_p)
    return scaled_logits


def probabilities(
    filtered: torch.Tensor, greedy_token_ids: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """fp32 [N, V]: the distribution each row samples from, given its `filtered_logits`
    (softmaxed for random rows; a one-hot on the argmax for greedy rows)."""
    probs = torch.softmax(filtered, dim=-1)
    point = torch.zeros_like(probs).scatter_(1, greedy_token_ids[:, None], 1.0)
    return torch.where((batch.temperature == 0.0)[:, None], point, probs)
