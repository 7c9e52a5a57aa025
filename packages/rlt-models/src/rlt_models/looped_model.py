"""`LoopedModelBase`: what every family's model shares (embedding, head, RoPE, path selection).

A family's model subclasses it and adds its layers and `recurrent_step` (one loop of its
recurrent block); the runner sees only the `LoopedLanguageModel` protocol and the family's
declaration (`model.family`). The plain attributes `fused_path` ("auto", "triton", "torch",
"off": README.md, "Fused decode path") and `batch_invariant` (README.md, "Batch-invariant
mode"; attention is the bound `LayerAttention`'s business) select how the model computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rlt_contracts import FamilyDeclaration, LoopedModelShape
from torch import nn

from rlt_models import batch_invariant, fused_ops
from rlt_models.fp8_linear import project
from rlt_models.layers import DEFAULT_OPS, ModelOps, RotaryEmbedding, empty_parameter
from rlt_models.small_batch_linear import small_batch_linear

FUSED_PATHS = ("auto", "triton", "torch", "off")
BATCH_INVARIANT_OPS = ModelOps(
    batch_invariant.linear, batch_invariant.silu, batch_invariant.sigmoid
)


class LoopedModelBase(nn.Module):
    """Token embedding (`embed_tokens`), LM head (`lm_head`), RoPE and the path switches.

    `config` needs vocab_size, hidden_size, head_dim, rope_theta, max_position_embeddings and
    `shape()`; `family` is the family's declaration.
    """

    def __init__(self, config, family: FamilyDeclaration) -> None:
        super().__init__()
        self.config = config
        self.family = family
        self.shape: LoopedModelShape = config.shape()
        d = config.hidden_size
        self.embed_tokens = empty_parameter(config.vocab_size, d)
        self.lm_head = empty_parameter(config.vocab_size, d)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings
        )
        self.fused_path = "auto"
        self.batch_invariant = False
        # set by `build_model`: "fp8" when the projections are `Fp8Projection`s, else None
        self.quantization: str | None = None
        self.quantized_lm_head = False
        # the checkpoint's per-layer (key, value) fp8 KV scales, if it has them (kv_scales.py)
        self.checkpoint_kv_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    @property
    def ops(self) -> ModelOps:
        """The batch-sensitive ops of the eager path, LM head and gate (see `batch_invariant`)."""
        if self.batch_invariant:
            return BATCH_INVARIANT_OPS
        return DEFAULT_OPS

    def fused_impl(self, hidden: torch.Tensor) -> str | None:
        """The `fused_ops` impl ("triton" / "torch") `recurrent_step` uses for `hidden`, or None
        for the eager path."""
        path = self.fused_path
        if path == "off":
            return None
        if path == "auto":
            if hidden.is_cuda and fused_ops.triton_unavailable_reason() is None:
                return "triton"
            return None
        if path in ("triton", "torch"):
            return path
        raise ValueError(f"fused_path must be one of {FUSED_PATHS}, got {path!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Prelude: token ids [N] -> hidden [N, d] (plain lookup, no scaling)."""
        return F.embedding(token_ids, self.embed_tokens)

    def coda(self, hidden: torch.Tensor, *, needed: torch.Tensor | None = None) -> torch.Tensor:
        """LM head: hidden [N, d] -> logits [N, V] in the model dtype. `needed` (device int32
        [1]): where 0, the small-batch Triton head skips reading its weight and returns zeros
        (cuBLAS and the batch-invariant GEMM always compute)."""
        if self.batch_invariant:
            return project(batch_invariant.linear, hidden, self.lm_head)
        return project(small_batch_linear, hidden, self.lm_head, needed)
