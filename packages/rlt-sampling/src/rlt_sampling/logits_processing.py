"""The logits adjustments that precede temperature, in one place: `adjust_logits`.

vLLM's V1 order (so the same parameters give the same distribution), on the RAW logits
converted to fp32, for every row at once: 0 structured output's allowed-token bitmask
(`token_mask.py`), 1 min_tokens (-inf at the stop ids while the sampled output index is below
it), 2 logit_bias, 3-5 repetition, frequency and presence penalties; README.md, "Logits
adjustments", gives each rule and what follows in `Sampler`. Steps are selected by the
`SamplingMode` flags (`constrained`, `min_tokens`, `biased`, `penalized`); a row at the neutral
values comes out bitwise unchanged, and -inf stays -inf through every later step.

Cost over [N, V] per step: min_tokens one masked fill; logit_bias one scatter-add over [N, K];
penalties about eleven elementwise passes (two compares and an or for the masks, divide,
multiply and two wheres for the repetition penalty, two multiply-subtracts).
"""

from __future__ import annotations

import torch
from rlt_contracts import LogitsAdjustments, SamplingMode

from rlt_sampling.token_mask import apply_token_bitmask_


def adjust_logits(
    logits: torch.Tensor,
    adjustments: LogitsAdjustments,
    *,
    counter: torch.Tensor,
    mode: SamplingMode,
) -> torch.Tensor:
    """fp32 [N, V] copy of `logits` (any float dtype; not modified) with the steps of `mode`
    applied in the documented order. counter: int64 [N], the output index being sampled."""
    adjusted = logits.to(torch.float32, copy=True)
    if mode.constrained:
        apply_token_bitmask_(adjusted, adjustments.token_bitmask)
    if mode.min_tokens:
        before_min = counter < adjustments.min_tokens
        adjusted.masked_fill_(adjustments.stop_mask & before_min[:, None], float("-inf"))
    if mode.biased:
        adjusted.scatter_add_(1, adjustments.bias_token_ids, adjustments.bias_values)
    if mode.penalized:
        adjusted = _apply_penalties(adjusted, adjustments)
    return adjusted


def _apply_penalties(logits: torch.Tensor, adjustments: LogitsAdjustments) -> torch.Tensor:
    counts = adjustments.output_counts
    in_output = counts > 0
    seen = adjustments.prompt_mask | in_output
    repetition = adjustments.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits -= adjustments.frequency_penalty[:, None] * counts
    logits -= adjustments.presence_penalty[:, None] * in_output
    return logits
