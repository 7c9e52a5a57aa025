"""Model-side protocols: what the runner needs from a looped language model and its attention.

Tensors are torch tensors; they are typed `Any` here so this package stays free of torch.
Shapes use N = number of token rows in the call, d = hidden size, H / Hkv = query / KV heads,
D = head dim, V = vocabulary size. Rows are packed ("varlen"): there is no batch padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from rlt_contracts.sampling import SamplingRow

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


class SampledRows(Protocol):
    """Tokens sampled on the device; `token_ids` [N] int64 stays there for the next prelude."""

    token_ids: Tensor

    def to_host(self) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
        """Per row: (token_id, logprob or None, top alternatives); one device->host transfer."""
        ...


class TokenSampler(Protocol):
    """logits [N, V] -> one token per row, each row with its own parameters and stream."""

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SampledRows: ...
