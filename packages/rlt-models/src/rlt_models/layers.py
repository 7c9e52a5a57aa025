"""Building blocks of the Ouro layer with the reference numerics (ouro-model-spec.md 3.3-3.5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlt_models.fp8_linear import project


def empty_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised, frozen parameter: weights always come from a checkpoint (no random
    init is paid at construction)."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm: fp32 mean-square and normalisation, cast back to the activation dtype, then
    multiplied by the weight in that dtype (the order matters for bit-exactness in bf16)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding:
    """Split-half (GPT-NeoX) RoPE with fp32 frequencies and angles, cast to the activation dtype.

    The fp32 `inv_freq` is not a module buffer, so casting the model to bf16 never rounds it; it
    follows the positions' device on first use. On CUDA, cos/sin of every position below
    `max_positions` are computed once per dtype (the same elementwise ops, so the same values)
    and looked up: one gather per loop instead of seven small kernels.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int = 0) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        self.max_positions = max_positions
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, *, table: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] in `dtype` for integer `positions` [N]. `table`: look them up
        in the per-position table on the CPU too (batch-invariant mode: a position's values
        are then computed once, never in a call whose size depends on the batch)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if (positions.is_cuda or table) and self.max_positions:
            table = self._tables.get((positions.device, dtype))
            if table is None:
                every = torch.arange(self.max_positions, device=positions.device)
                table = torch.stack(self._compute(every, dtype), dim=1)  # [P, 2, D]
                self._tables[(positions.device, dtype)] = table
            pair = table[positions]
            return pair[:, 0], pair[:, 1]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype):
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, D]: x*cos + rot(x)*sin, rot = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size)
        self.down_proj = empty_parameter(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        ops = ops or DEFAULT_OPS
        gate, up = project(ops.linear, x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return project(ops.linear, ops.silu(gate) * up, self.down_proj)


class ModelOps(NamedTuple):
    """The ops whose results can depend on the batch: the default torch ones, or the
    batch-invariant ones of `rlt_models.batch_invariant` (`OuroModel.batch_invariant`)."""

    linear: Callable[..., torch.Tensor]
    silu: Callable[[torch.Tensor], torch.Tensor]
    sigmoid: Callable[[torch.Tensor], torch.Tensor]


DEFAULT_OPS = ModelOps(F.linear, F.silu, torch.sigmoid)
