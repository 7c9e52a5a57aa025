"""FP8 weights: float8_e4m3fn with one fp32 scale per output channel (README.md, "FP8 weights":
the format, s_n = max_k |W_nk| / 448, and why the bytes sit in integer buffers).

`Fp8Projection` holds one such weight. Its reference product (`forward`) dequantizes to the
activation dtype and calls the given linear (F.linear, the small-batch GEMV or the batch-
invariant GEMM): on the CPU in fp32 this is exactly the model whose weights are the dequantized
values, which is what the tests compare against. On CUDA the engine's projections run the
kernels of `fp8_linear` instead (weight-only GEMV, W8A8), chosen by measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# A row of zeros gets this scale (its Q is 0 either way) instead of a division by zero.
MIN_SCALE = 1e-12


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (Q [N, K] float8_e4m3fn, s [N] fp32), W ~ s[:, None] * Q."""
    if weight.dim() != 2:
        raise ValueError(f"a projection weight is 2-D, got shape {tuple(weight.shape)}")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    data = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s[:, None] * Q in fp32, then rounded once to `dtype`."""
    return (data.float() * scale.float()[:, None]).to(dtype)


class Fp8Projection(nn.Module):
    """One fp8 projection weight (see the module doc); `weight` [N, K] fp8, `scale` [N] fp32."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if data.dtype != FP8:
            raise ValueError(f"fp8 data must be {FP8}, got {data.dtype}")
        if scale.shape != (data.shape[0],):
            raise ValueError(
                f"one scale per output channel: expected ({data.shape[0]},), got "
                f"{tuple(scale.shape)}"
            )
        self.register_buffer("data_bytes", data.contiguous().view(torch.uint8))
        self.register_buffer("scale_bits", scale.float().contiguous().view(torch.int32))

    @property
    def weight(self) -> torch.Tensor:
        return self.data_bytes.view(FP8)

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float32)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale, dtype)

    def forward(
        self, x: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear
    ) -> torch.Tensor:
        """x [M, K] @ dequantized(W).T with `linear` (the reference path)."""
        return linear(x, self.dequantized(x.dtype))
