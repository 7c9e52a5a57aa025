"""Shared pieces of training and evaluating the embedded Ouro model.

The model is rlt-models' `OuroModel`, run teacher-forced over B packed windows of S tokens:
N = B * S rows, positions 0..S-1 in every window. Each loop is one `recurrent_step` over the
whole batch with causal attention over its own window, so every loop attends to its own loop's
keys (the per-loop KV of ouro-model-spec.md 3.9).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rlt_models import OuroConfig, OuroModel

TOKEN_DTYPE = np.dtype("<u2")


def config_b() -> OuroConfig:
    """Config B of embedded-model.md: 4096 vocab, d 256, 4 x 64 heads, 4 shared layers looped
    4 times, SwiGLU 768; 5.51 M parameters (11 MB in bf16). RoPE base 10,000 suits a
    1,024-token context (Ouro's 1e6 is for 64k)."""
    return OuroConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        total_ut_steps=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        eos_token_id=(0,),
        torch_dtype="bfloat16",
    )


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """A flat uint16 token file (see pretokenize.py) as an int64 tensor [n] on `device`."""
    return torch.from_numpy(np.fromfile(path, dtype=TOKEN_DTYPE).astype(np.int64)).to(device)


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows tokens[start : start + seq_len + 1] for each start [B] -> [B, seq_len + 1]."""
    offsets = torch.arange(seq_len + 1, device=tokens.device)
    return tokens[starts.to(tokens.device)[:, None] + offsets]


class CausalSdpaAttention:
    """`LayerAttention` over `batch` packed windows of `seq_len` tokens (rows window-major).

    query [N, H, D], key/value [N, Hkv, D] -> causal SDPA within each window -> [N, H, D].
    q and k are cast to v's dtype (under autocast the RoPE output is fp32 while v is bf16).
    """

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch = batch
        self.seq_len = seq_len

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        b, s = self.batch, self.seq_len
        q, k, v = (
            t.to(value.dtype).view(b, s, t.shape[1], t.shape[2]).transpose(1, 2)
            for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[3])


def loop_states(model: OuroModel, inputs: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced full-depth forward of inputs [B, S]: the normed state of every loop,
    T tensors [B * S, d] (loop 1 first)."""
    b, s = inputs.shape
    positions = torch.arange(s, device=inputs.device).repeat(b)
    attention = CausalSdpaAttention(b, s)
    hidden = model.embed(inputs.reshape(-1))
    states = []
    for _ in range(model.config.total_ut_steps):
        hidden, _ = model.recurrent_step(hidden, positions, attention, compute_gate=False)
        states.append(hidden)
    return states


def loop_losses(
    model: OuroModel, states: list[torch.Tensor], targets: torch.Tensor
) -> torch.Tensor:
    """Per-token next-token cross-entropy of the LM head on each loop's state: [T, N] fp32."""
    flat = targets.reshape(-1)
    return torch.stack(
        [F.cross_entropy(model.coda(h).float(), flat, reduction="none") for h in states]
    )


def gate_logits(model: OuroModel, states: list[torch.Tensor]) -> torch.Tensor:
    """Exit-gate logits [len(states), N] in fp32 with autocast off; sigmoid of them equals the
    runtime's `OuroModel.exit_probability` (the engine's gate numerics)."""
    weight, bias = model.early_exit_gate_weight, model.early_exit_gate_bias
    with torch.autocast(states[0].device.type, enabled=False):
        return torch.stack(
            [F.linear(h.float(), weight.float(), bias.float()).squeeze(-1) for h in states]
        )


def exit_log_distribution(logits: torch.Tensor) -> torch.Tensor:
    """log p(t | x) [T, N] of spec 3.7 from gate logits [T, N]: p_t = lambda_t prod_{j<t}
    (1 - lambda_j) for t < T; the last loop takes the remaining mass (its gate is unused)."""
    log_continue = F.logsigmoid(-logits[:-1]).cumsum(0)  # log prod_{j<=t} (1 - lambda_j)
    log_survival = F.pad(log_continue, (0, 0, 1, 0))  # log prod_{j<t}; 0 for t = 1
    log_exit_here = F.pad(F.logsigmoid(logits[:-1]), (0, 0, 0, 1))  # log lambda_t; 0 for t = T
    return log_survival + log_exit_here
