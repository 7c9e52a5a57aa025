"""The Ouro looped transformer, split into prelude (embedding), recurrent step and coda.

One recurrent step = all L shared layers + the end-of-loop RMSNorm (+ the exit gate in fp32).
Token positions, and therefore RoPE phases, do not change across loops. Attention goes through
the `LayerAttention` the caller binds, so the same model runs over paged KV (rlt-runner) or a
dense per-sequence cache (`DenseCausalAttention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rlt_contracts import LayerAttention, LoopedModelShape
from torch import nn

from rlt_models.config import OuroConfig
from rlt_models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, empty_parameter


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
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = F.linear(self.input_layernorm(x), self.qkv_proj).split(self.qkv_split, dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = attention(self.layer_index, q, k, v).reshape(n, -1)
        x = x + self.input_layernorm_2(F.linear(attn, self.o_proj))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroModel(nn.Module):
    """Ouro with the `LoopedLanguageModel` interface (see rlt_contracts.model)."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.shape: LoopedModelShape = config.shape()
        d = config.hidden_size
        self.embed_tokens = empty_parameter(config.vocab_size, d)
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.early_exit_gate_weight = empty_parameter(1, d)
        self.early_exit_gate_bias = empty_parameter(1)
        self.lm_head = empty_parameter(config.vocab_size, d)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Prelude: token ids [N] -> hidden [N, d] (plain lookup, no scaling)."""
        return F.embedding(token_ids, self.embed_tokens)

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One loop: all layers then the shared end-of-loop norm; gate probability in fp32."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        x = hidden
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        x = self.norm(x)
        if not compute_gate:
            return x, None
        return x, self.exit_probability(x)

    def exit_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """sigmoid(gate(h)) [N] in fp32 from the normed state h [N, d] (vllm-rlt numerics)."""
        weight, bias = self.early_exit_gate_weight, self.early_exit_gate_bias
        logits = F.linear(hidden.float(), weight.float(), bias.float())
        return torch.sigmoid(logits.squeeze(-1))

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [N, d] -> logits [N, V] in the model dtype."""
        return F.linear(hidden, self.lm_head)
