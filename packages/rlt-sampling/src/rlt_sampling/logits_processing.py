"""The logits adjustments that precede temperature, in one place: `adjust_logits`.

Order (vLLM's V1 sampler, so the same parameters give the same distribution), all on the RAW
logits converted to fp32, for every row at once:

    0  constrained  structured output's allowed-token bitmask: disallowed ids -> -inf
                    (`token_mask.py`; first, as vLLM applies the grammar bitmask before its
                    sampler)
    1  min_tokens   rows whose sampled output index (`counter`) is below their min_tokens get
                    -inf at their stop token ids (request stop ids and EOS, even under
                    ignore_eos: vLLM's all_stop_token_ids)
    2  logit_bias   logits[v] += bias[v] for the row's (token id, bias) entries
    3  repetition   tokens in the prompt or the outputs so far:
                        logit / r if logit > 0 else logit * r
    4  frequency    logits -= frequency_penalty * output_count
    5  presence     logits -= presence_penalty * (output_count > 0)

then, in `Sampler`: greedy rows take the argmax of the adjusted logits; random rows divide by
temperature, drop tokens under min_p (`filtering.mask_min_p`), apply top-k / top-p and draw.
Logprobs stay log_softmax of the raw logits (before all of the above).

Steps 0-5 are selected by the `SamplingMode` flags (`constrained`, `min_tokens`, `biased`,
`penalized`); a row whose values are neutral (all-ones bitmask, min_tokens 0, no bias entries,
penalties 1 / 0 / 0) comes out
bitwise unchanged, so rows with and without a feature share one batch. -inf stays -inf through
every later step (a bias or a penalty cannot bring back a masked stop id).

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
