"""The Ouro looped transformer, split into prelude (embedding), recurrent step and coda.

One recurrent step = all L shared layers + the end-of-loop RMSNorm (+ the exit gate in fp32).
Token positions, and therefore RoPE phases, do not change across loops. Attention goes through
the `LayerAttention` the caller binds, so the same model runs over paged KV (rlt-runner) or a
dense per-sequence cache (`DenseCausalAttention`).

Two execution paths compute the same loop (`OuroModel.fused_path`):
- eager (`OuroDecoderLayer.forward`): the modules of `layers.py`, one torch op at a time.
- fused (`OuroDecoderLayer.forward_fused`): the residual stream and the next sublayer's normed
  input travel together; a layer is qkv GEMM -> `rotary_qk_` -> attention -> o GEMM ->
  `add_rms_norm` -> gate_up GEMM -> `silu_mul` -> down GEMM -> `add_rms_norm` (whose second norm
  is the next layer's input norm, or the end-of-loop norm after the last layer), with the
  elementwise ops of `fused_ops` (Triton kernels on CUDA); its exit gate is one kernel
  (`fused_ops.exit_gate`). (Computing silu_mul inside the down projection's one-row GEMV
  instead, one kernel less per layer, made decode ~10% slower on an H200: each of its 1,024
  CTAs recomputed the whole 5,632-wide input.)

`OuroModel.batch_invariant` swaps the ops whose results can depend on the batch (the GEMMs, the
fp32 sigmoid/silu, RoPE's cos/sin) for those of `rlt_models.batch_invariant`, so that a row's
values depend only on its own token, position and attention context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import batch_invariant, fused_ops
from rlt_models.config import OuroConfig
from rlt_models.fp8_linear import project
from rlt_models.layers import DEFAULT_OPS, ModelOps, RMSNorm, SwiGLU, apply_rotary, empty_parameter
from rlt_models.looped_model import LoopedModelBase
from rlt_models.small_batch_linear import small_batch_linear


class OuroDecoderLayer(nn.Module):
    """Sandwich-norm layer: x += norm2(attn(norm1(x))); x += norm4(mlp(norm3(x)))."""

    def __init__(self, config: OuroConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_split = (q_size, kv_size, kv_size)
        d = config.hidden_size
        self.qkv_proj = empty_parameter(q_size + 2 * kv_size, d)
        self.o_proj = empty_parameter(d, q_size)
        self.mlp = SwiGLU(d, config.intermediate_size)
        eps = config.rms_norm_eps
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
        n = x.shape[0]
        qkv = project(ops.linear, self.input_layernorm(x), self.qkv_proj)
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = attention(self.layer_index, q, k, v).reshape(n, -1)
        x = x + self.input_layernorm_2(project(ops.linear, attn, self.o_proj))
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
        n = x.shape[0]
        if invariant:
            linear = batch_invariant.linear
        else:
            linear = small_batch_linear if impl == "triton" else F.linear
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size, _ = self.qkv_split
        qkv = project(linear, normed, self.qkv_proj)
        fused_ops.rotary_qk_(qkv, cos, sin, heads, kv_heads, head_dim, impl=impl)
        q = qkv[:, :q_size].view(n, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(n, kv_heads, head_dim)
        attn = attention(self.layer_index, q, k, v).reshape(n, -1)
        eps = self.input_layernorm.eps
        x, m = fused_ops.add_rms_norm(
            x,
            project(linear, attn, self.o_proj),
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
        layers = self.layers
        eps = self.norm.eps
        x = hidden
        normed = fused_ops.rms_norm(x, layers[0].input_layernorm.weight, eps, impl=impl)
        for index, layer in enumerate(layers):
            last = index + 1 == len(layers)
            next_weight = self.norm.weight if last else layers[index + 1].input_layernorm.weight
            x, normed = layer.forward_fused(
                x,
                normed,
                cos,
                sin,
                attention,
                next_weight,
                impl=impl,
                invariant=self.batch_invariant,
            )
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
