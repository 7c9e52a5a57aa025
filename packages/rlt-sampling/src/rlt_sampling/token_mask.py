"""Structured output on the device: an allowed-token bitmask applied to logits.

The bitmask of N rows is int32 [N, ceil(V / 32)]: bit t % 32 of word t // 32 is set when token
t may be sampled (the layout xgrammar and llguidance fill, and `TokenMask.words` carries). A row
without a grammar has every bit set (-1 words) and comes out unchanged, so constrained and free
rows share a batch. Cost over [N, V]: one shift-and-and, one masked fill; no host sync.
"""

from __future__ import annotations

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits [N, V] (modified in place, returned) to -inf where the bit of int32 `bitmask`
    [N, >= ceil(V / 32)] is clear."""
    rows, vocab = logits.shape
    # Byte-wise (little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7),
    # so the transient is N x V bytes (39 MB at 256 rows of Ouro's 151,936), not 4 N x V.
    words = bitmask[:, : bitmask_words(vocab)].contiguous()
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (words.view(torch.uint8)[:, :, None] >> shifts) & 1
    allowed = bits.view(rows, -1)[:, :vocab].to(torch.bool)
    return logits.masked_fill_(~allowed, float("-inf"))
