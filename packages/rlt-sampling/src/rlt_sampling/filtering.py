"""Per-row filters of temperature-scaled logits: min_p, then top-k and top-p (one sort per batch).

min_p (`mask_min_p`, vLLM's rule) drops tokens whose probability is below min_p times the row's
largest one; it runs before top-k / top-p, which then see only the survivors. Both of those act
on ranks of one stable descending sort, so among equal logits the LOWER token id ranks first:
top-k keeps exactly min(k, V) tokens (top_k = 1 is greedy), top-p the shortest rank prefix whose
mass reaches p, computed in fp32 on the distribution renormalised over the top-k survivors
(README.md, "Semantics worth knowing": ties and numerics).
"""

from __future__ import annotations

import torch


def mask_top_k_top_p(
    scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered copy of `scaled_logits` with removed tokens set to -inf.

    scaled_logits: fp32 [N, V], already divided by each row's temperature; not modified.
    top_k: int64 [N]; k <= 0 or k >= V disables top-k for that row.
    top_p: fp32 [N] in (0, 1]; 1 disables top-p for that row.
    Returns fp32 [N, V] on the same device; every row keeps at least its most likely token.
    """
    vocab_size = scaled_logits.shape[-1]
    sorted_logits, sorted_token_ids = torch.sort(
        scaled_logits, dim=-1, descending=True, stable=True
    )
    ranks = torch.arange(vocab_size, device=scaled_logits.device)
    kept_count = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    removed_sorted = ranks[None, :] >= kept_count[:, None]

    sorted_logits = sorted_logits.masked_fill_(removed_sorted, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
    nucleus_done = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    removed_sorted |= nucleus_done
    removed_sorted[:, 0] = False  # the most likely token always survives

    removed = torch.empty_like(removed_sorted).scatter_(1, sorted_token_ids, removed_sorted)
    return scaled_logits.masked_fill(removed, float("-inf"))


def mask_min_p(scaled_logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Copy of `scaled_logits` (fp32 [N, V], temperature applied; not modified) with -inf where
    a token's probability is below min_p times the row's largest probability (vLLM's min_p).

    min_p: fp32 [N] in [0, 1]; 0 keeps every token. The most likely token always stays.
    """
    probs = torch.softmax(scaled_logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
    return scaled_logits.masked_fill(probs < threshold, float("-inf"))
