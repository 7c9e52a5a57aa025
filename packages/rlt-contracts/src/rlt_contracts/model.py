"""Model-side protocols: what the runner needs from a looped language model and its attention.

Tensors are torch tensors; they are typed `Any` here so this package stays free of torch.
Shapes use N = number of token rows in the call, d = hidden size, H / Hkv = query / KV heads,
D = head dim, V = vocabulary size. Rows are packed ("varlen"): there is no batch padding.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

Tensor = Any


class LoopedModelShape(msgspec.Struct, frozen=True):
    """Static shape of a recurrent looped transformer (prelude -> T x recurrent -> coda)."""

    num_layers: int  # physical layers in the shared recurrent stack (L)
    num_loops: int  # model depth T: loops applied per token at most
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


class LayerAttention(Protocol):
    """Attention of one model call, bound to the batch's KV metadata by the runner.

    Called once per physical layer per loop with post-RoPE `query` [N, H, D], `key` [N, Hkv, D]
    and `value` [N, Hkv, D] of the call's tokens. It stores key/value into the KV cache (where
    the call's metadata says) and returns the attention output [N, H, D] (softmax scale D^-0.5,
    causal over each row's visible context).
    """

    def __call__(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor: ...


class LoopedLanguageModel(Protocol):
    """Prelude / recurrent step / coda split of a looped model (see ouro-model-spec.md 3.11).

    embed: prelude. token_ids [N] int64 -> hidden [N, d] in the model dtype.
    recurrent_step: one loop over all L layers plus the end-of-loop norm at fixed `positions`
      [N] int64. Returns the normed hidden state [N, d] (the next loop's input) and, when
      `compute_gate`, the exit-gate probability sigmoid(gate) [N] in fp32 (else None).
    coda: LM head. hidden [N, d] -> logits [N, V] (model dtype).
    """

    shape: LoopedModelShape

    def embed(self, token_ids: Tensor) -> Tensor: ...

    def recurrent_step(
        self,
        hidden: Tensor,
        positions: Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[Tensor, Tensor | None]: ...

    def coda(self, hidden: Tensor) -> Tensor: ...


class SamplingMode(msgspec.Struct, frozen=True):
    """Which sampling work a batch of rows needs (host flags, fixed per captured graph).

    random: some row has temperature > 0 (Gumbel noise is drawn; greedy rows still take argmax).
    filtered: some random row uses top-k or top-p (one sort per batch).
    top_logprobs: None when no row wants logprobs; otherwise the number of alternatives
      computed for every row (each request keeps its own count of them).
    """

    random: bool = False
    filtered: bool = False
    top_logprobs: int | None = None


class SampledRows(Protocol):
    """Device results of sampling N rows (nothing is read back by the sampler).

    token_ids [N] int64; logprobs [N] fp32, top_token_ids [N, k] int64 and top_logprobs [N, k]
    fp32 are None unless the mode asked for logprobs.
    """

    token_ids: Tensor
    logprobs: Tensor | None
    top_token_ids: Tensor | None
    top_logprobs: Tensor | None


class TokenSampler(Protocol):
    """logits [N, V] -> one token per row, each row with its own parameters and random stream.

    Per-row parameters are device tensors [N]: temperature fp32 (0 = greedy), top_k int64
    (<= 0 disabled), top_p fp32, seed int64, counter int64 (the output index being sampled: the
    row's position in its request's random stream). Launches device work only (capturable in a
    CUDA graph for a fixed `mode`).
    """

    def sample_rows(
        self,
        logits: Tensor,
        *,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        seed: Tensor,
        counter: Tensor,
        mode: SamplingMode,
    ) -> SampledRows: ...
