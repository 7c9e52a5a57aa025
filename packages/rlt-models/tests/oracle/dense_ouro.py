"""Dense reference of the Ouro forward pass (ouro-model-spec.md section 3), written literally.

Full-sequence, one sequence, computed in float64 by default: every loop, a separate KV cache per
(loop, layer), the end-of-loop norm, the exit gate and the exit distribution/CDF of section 3.7.
It reads the checkpoint with safetensors and the config as a plain dict, so it shares no code
with rlt-models.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


@dataclass
class LayerKV:
    """Keys/values [P, Hkv, D] of earlier positions, for one (loop, layer) cache slot."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class DenseForward:
    """Per-loop results for S positions (T = loops).

    hidden: [T, S, d] normed state after each loop; gate_logits: [T, S];
    exit_pdf / exit_cdf: [T, S] per 3.7 (the last loop takes the remaining mass);
    logits: [T, S, V] LM head of each loop's state.
    """

    hidden: torch.Tensor
    gate_logits: torch.Tensor
    exit_pdf: torch.Tensor
    exit_cdf: torch.Tensor
    logits: torch.Tensor


class DenseOuro:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float64) -> None:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        self.dtype = dtype
        self.hidden_size = cfg["hidden_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_heads
        self.loops = cfg.get("total_ut_steps", 4)
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.theta = cfg.get("rope_theta", 1e6)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            raw = {}
            for shard in shards:
                raw.update(load_file(str(model_dir / shard)))
        else:
            raw = load_file(str(model_dir / "model.safetensors"))
        self.w = {name: tensor.to(dtype) for name, tensor in raw.items()}

    # -- pieces of section 3 ------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [S, heads, D]; split-half rotation with angle p * theta^(-2j/D)."""
        half = self.head_dim // 2
        j = torch.arange(half, dtype=torch.float64)
        inv_freq = 1.0 / (self.theta ** (2 * j / self.head_dim))
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(self.dtype)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(self.dtype)[:, None, :]
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention: query at position p sees keys at positions <= p."""
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        for h in range(self.num_heads):
            kh, vh = keys[:, h // group], values[:, h // group]
            scores = (q[:, h] @ kh.T) / math.sqrt(self.head_dim)
            mask = key_positions[None, :] > query_positions[:, None]
            scores = scores.masked_fill(mask, float("-inf"))
            out[:, h] = torch.softmax(scores, -1) @ vh
        return out

    def layer(
        self, x: torch.Tensor, layer: int, positions: torch.Tensor, past: LayerKV | None
    ) -> tuple[torch.Tensor, LayerKV]:
        """One decoder layer (3.5) on S new positions; returns x and the S new (k, v) entries."""
        p = f"model.layers.{layer}."
        w = self.w
        s = x.shape[0]
        a = self.rms_norm(x, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(s, self.num_heads, self.head_dim)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).view(s, self.num_kv_heads, self.head_dim)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(s, self.num_kv_heads, self.head_dim)
        q, k = self.rope(q, positions), self.rope(k, positions)
        if past is None or past.keys.shape[0] == 0:
            keys, values, key_positions = k, v, positions
        else:
            keys, values = torch.cat([past.keys, k]), torch.cat([past.values, v])
            key_positions = torch.cat(
                [torch.arange(past.keys.shape[0], dtype=positions.dtype), positions]
            )
        o = self.attention(q, keys, values, positions, key_positions).reshape(s, -1)
        x = x + self.rms_norm(
            o @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"]
        )
        m = self.rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        f = (gate * torch.sigmoid(gate) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        x = x + self.rms_norm(f, w[p + "post_attention_layernorm_2.weight"])
        return x, LayerKV(k, v)

    def loop(
        self, h: torch.Tensor, positions: torch.Tensor, past: list[LayerKV | None]
    ) -> tuple[torch.Tensor, list[LayerKV], torch.Tensor]:
        """All layers then the end-of-loop norm; returns normed h, new KV per layer, gate logit."""
        new_kv = []
        for layer in range(self.num_layers):
            h, kv = self.layer(h, layer, positions, past[layer])
            new_kv.append(kv)
        h = self.rms_norm(h, self.w["model.norm.weight"])
        gate = (h @ self.w["model.early_exit_gate.weight"].T).squeeze(-1) + self.w[
            "model.early_exit_gate.bias"
        ]
        return h, new_kv, gate

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"][token_ids]

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w["lm_head.weight"].T

    # -- full-sequence forward ---------------------------------------------------------------
    def forward(self, token_ids: list[int]) -> DenseForward:
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(len(token_ids))
        h = self.embed(ids)
        hidden, gates = [], []
        for _ in range(self.loops):
            h, _, gate = self.loop(h, positions, [None] * self.num_layers)
            hidden.append(h)
            gates.append(gate)
        gate_logits = torch.stack(gates)
        pdf, cdf = exit_distribution(gate_logits)
        hidden_t = torch.stack(hidden)
        return DenseForward(hidden_t, gate_logits, pdf, cdf, self.lm_head(hidden_t))


def exit_distribution(gate_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pdf / cdf [T, S] of 3.7: p_t = lambda_t * S_{t-1}; the last loop takes the rest."""
    lam = torch.sigmoid(gate_logits)
    loops = gate_logits.shape[0]
    survival = torch.ones_like(lam[0])
    pdf = []
    for t in range(loops):
        if t < loops - 1:
            pdf.append(lam[t] * survival)
            survival = survival * (1 - lam[t])
        else:
            pdf.append(survival)
    pdf_t = torch.stack(pdf)
    return pdf_t, pdf_t.cumsum(0)
