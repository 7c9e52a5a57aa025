"""`ProjectedAttentionLayer`: the attention block and SwiGLU that Ouro's sandwich layer and the
pre-norm (Llama) layers of other families share; each family arranges its norms and residuals
around them.

`attend` is q/k/v in one projection, RoPE on q and k, the bound `LayerAttention`, then the
o projection. On the eager path (`impl` None) q and k are rotated by `apply_rotary`; on the
fused path by `fused_ops.rotary_qk_` in place on the packed projection (the "torch" impl is
bit-identical to eager).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import batch_invariant, fused_ops
from rlt_models.fp8_linear import project
from rlt_models.layers import SwiGLU, apply_rotary, empty_parameter
from rlt_models.small_batch_linear import small_batch_linear


def fused_linear(impl: str, invariant: bool):
    """The projection of the fused path: the batch-invariant GEMM when `invariant`, else the
    measured small-batch kernel with "triton" (few rows) and F.linear with "torch"."""
    if invariant:
        return batch_invariant.linear
    return small_batch_linear if impl == "triton" else F.linear


class ProjectedAttentionLayer(nn.Module):
    """q/k/v (fused, order q, k, v) and o projections over `config`'s heads, and a SwiGLU."""

    def __init__(self, config, layer_index: int) -> None:
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

    def attend(
        self,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: LayerAttention,
        linear,
        impl: str | None,
    ) -> torch.Tensor:
        """o(attention(rope(q), rope(k), v)) of the layer's normed input [N, d] -> [N, d]."""
        n = normed.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size, _ = self.qkv_split
        qkv = project(linear, normed, self.qkv_proj)
        if impl is None:
            q, k, v = qkv.split(self.qkv_split, dim=-1)
            q = apply_rotary(q.view(n, heads, head_dim), cos, sin)
            k = apply_rotary(k.view(n, kv_heads, head_dim), cos, sin)
            v = v.view(n, kv_heads, head_dim)
        else:
            fused_ops.rotary_qk_(qkv, cos, sin, heads, kv_heads, head_dim, impl=impl)
            q = qkv[:, :q_size].view(n, heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(n, kv_heads, head_dim)
        out = attention(self.layer_index, q, k, v).reshape(n, -1)
        return project(linear, out, self.o_proj)


def run_fused_layers(
    layers, final_norm, hidden, cos, sin, attention: LayerAttention, *, impl: str, invariant: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers` (each with `input_layernorm` and `forward_fused`) on the fused path, the last
    one's output norm being `final_norm`: returns (raw output, final_norm(raw output))."""
    eps = final_norm.eps
    x = hidden
    normed = fused_ops.rms_norm(x, layers[0].input_layernorm.weight, eps, impl=impl)
    for index, layer in enumerate(layers):
        last = index + 1 == len(layers)
        next_weight = final_norm.weight if last else layers[index + 1].input_layernorm.weight
        x, normed = layer.forward_fused(
            x, normed, cos, sin, attention, next_weight, impl=impl, invariant=invariant
        )
    return x, normed
