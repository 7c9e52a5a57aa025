"""The Ouro looped transformer, split into prelude (embedding), recurrent step and coda.

One recurrent step = all L shared layers + the end-of-loop RMSNorm (+ the exit gate in fp32).
Token positions, and therefore RoPE phases, do not change across loops. Attention goes through
the `LayerAttention` the caller binds, so the same model runs over paged KV (rlt-runner) or a
dense per-sequence cache (`DenseCausalAttention`).

Two execution paths compute the same loop (`OuroModel.fused_path`): eager
(`OuroDecoderLayer.forward`, the modules of `layers.py`) and fused
(`OuroDecoderLayer.forward_fused`, the ops of `fused_ops`; README.md, "Fused decode path", gives
a layer's sequence). (Computing silu_mul inside the down projection's one-row GEMV instead, one
kernel less per layer, made decode ~10% slower on an H200: each of its 1,024 CTAs recomputed the
whole 5,632-wide input.) `OuroModel.batch_invariant`: README.md, "Batch-invariant mode".
"""

from __future__ import annotations

import torch
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import fused_ops
from rlt_models.attention_layer import ProjectedAttentionLayer, fused_linear, run_fused_layers
from rlt_models.config import OuroConfig
from rlt_models.fp8_linear import project
from rlt_models.layers import DEFAULT_OPS, ModelOps, RMSNorm, empty_parameter
from rlt_models.looped_model import LoopedModelBase


class OuroDecoderLayer(ProjectedAttentionLayer):
    """Sandwich-norm layer: x += norm2(attn(norm1(x))); x += norm4(mlp(norm3(x)))."""

    def __init__(self, config: OuroConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: LayerAttention,
        ops: ModelOps = DEFAULT_OPS,
    ) -> torch.Tensor:
        attn = self.attend(self.input_layernorm(x), cos, sin, attention, ops.linear, None)
        x = x + self.input_layernorm_2(attn)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x), ops))

    def forward_fused(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: LayerAttention,
        next_norm_weight: torch.Tensor,
        *,
        impl: str,
        invariant: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer on (x, input_layernorm(x)); returns (x', RMSNorm(x'; next_norm_weight))
        where next_norm_weight is the next layer's input norm (or the end-of-loop norm).
        `impl` ("triton" / "torch") picks the elementwise ops of `fused_ops`; with "triton"
        the projections of few rows may use the measured small-batch kernel. `invariant`: the
        projections use the batch-invariant GEMM instead (the fused elementwise Triton kernels
        compute each element or row alone; the "torch" references keep F.silu)."""
        linear = fused_linear(impl, invariant)
        eps = self.input_layernorm.eps
        x, m = fused_ops.add_rms_norm(
            x,
            self.attend(normed, cos, sin, attention, linear, impl),
            self.input_layernorm_2.weight,
            self.post_attention_layernorm.weight,
            eps,
            impl=impl,
        )
        gate_up = project(linear, m, self.mlp.gate_up_proj)
        act = fused_ops.silu_mul(gate_up, self.mlp.intermediate_size, impl=impl)
        return fused_ops.add_rms_norm(
            x,
            project(linear, act, self.mlp.down_proj),
            self.post_attention_layernorm_2.weight,
            next_norm_weight,
            eps,
            impl=impl,
        )


class OuroModel(LoopedModelBase):
    """Ouro with the `LoopedLanguageModel` interface (see rlt_contracts.model and
    `LoopedModelBase` for the path switches `fused_path` and `batch_invariant`)."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config, config.declaration())
        d = config.hidden_size
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.early_exit_gate_weight = empty_parameter(1, d)
        self.early_exit_gate_bias = empty_parameter(1)

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One loop: all layers then the shared end-of-loop norm; gate probability in fp32."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, table=self.batch_invariant)
        impl = self.fused_impl(hidden)
        if impl is None:
            x = hidden
            ops = self.ops
            for layer in self.layers:
                x = layer(x, cos, sin, attention, ops)
            x = self.norm(x)
        else:
            x = self._fused_layers(hidden, cos, sin, attention, impl)
        if not compute_gate:
            return x, None
        return x, self.exit_probability(x, impl=impl)

    def _fused_layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: LayerAttention,
        impl: str,
    ) -> torch.Tensor:
        """All layers and the end-of-loop norm on the fused path; returns the normed state."""
        _, normed = run_fused_layers(
            self.layers, self.norm, hidden, cos, sin, attention,
            impl=impl, invariant=self.batch_invariant,
        )  # fmt: skip
        return normed

    def exit_probability(self, hidden: torch.Tensor, impl: str | None = None) -> torch.Tensor:
        """sigmoid(gate(h)) [N] in fp32 from the normed state h [N, d] (vllm-rlt numerics).
        `impl` ("triton" / "torch"): the fused path's one-kernel gate (`fused_ops.exit_gate`),
        except in batch-invariant mode."""
        weight, bias = self.early_exit_gate_weight, self.early_exit_gate_bias
        if weight.dtype != torch.float32:  # the fp32 copy is made once, not in every loop
            cached = getattr(self, "_gate_fp32", None)
            if cached is None or cached[0].device != weight.device:
                cached = self._gate_fp32 = (weight.float(), bias.float())
            weight, bias = cached
        if impl is not None and not self.batch_invariant:
            return fused_ops.exit_gate(hidden, weight[0], bias, impl=impl)
        ops = self.ops
        logits = ops.linear(hidden.float(), weight, bias)
        return ops.sigmoid(logits.squeeze(-1))
