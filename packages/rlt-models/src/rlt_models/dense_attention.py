"""A plain dense causal attention for one sequence: the simplest `LayerAttention`.

`DenseKVCache` keeps the keys/values of one sequence at one loop depth (one cache per depth
gives the Hugging Face per-(loop, layer) cache of ouro-model-spec.md 3.9). Used by tests and by
offline tools; the engine uses paged attention backends instead.
"""

from __future__ import annotations

import torch


class DenseKVCache:
    """Per-layer key/value tensors [P, Hkv, D] of the positions seen so far."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self, layer_index: int = 0) -> int:
        cached = self.keys[layer_index]
        return 0 if cached is None else int(cached.shape[0])


class DenseCausalAttention:
    """Appends the call's keys/values to `cache` and attends causally (fp32 softmax).

    The call's N queries are the N positions right after the cached ones.
    """

    def __init__(self, cache: DenseKVCache) -> None:
        self.cache = cache

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        cached_k = self.cache.keys[layer_index]
        cached_v = self.cache.values[layer_index]
        keys = key if cached_k is None else torch.cat((cached_k, key))
        values = value if cached_v is None else torch.cat((cached_v, value))
        self.cache.keys[layer_index] = keys
        self.cache.values[layer_index] = values
        return dense_causal_attention(query, keys, values, window=window)


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """query [N, H, D] at the last N of the K positions of keys/values [K, Hkv, D] -> [N, H, D];
    `window` W: a query at position p sees keys p - W + 1 .. p only."""
    n, num_heads, head_dim = query.shape
    total = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, K, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
    q = query.transpose(0, 1).float()  # [H, N, D]
    scores = (q @ k.transpose(1, 2)) * head_dim**-0.5
    query_pos = torch.arange(total - n, total, device=query.device)[:, None]
    key_pos = torch.arange(total, device=query.device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(0, 1).to(query.dtype)
