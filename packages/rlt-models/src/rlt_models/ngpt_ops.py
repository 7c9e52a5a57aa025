"""Fused row-wise ops of the nGPT layer (Dory): a torch reference and a Triton kernel for each
(README.md, "Dory's fused nGPT path": the layer's sequence of GEMMs and these ops, numerics and
measurements).

unit(x) = x / sqrt(sum(x^2) + 1e-6) over the last dim: fp32 statistics, the product in fp32,
cast back to x's dtype (transformers' DoryL2Norm). Everything else is in the activation dtype
as eager torch computes it: each product / sum of two act-dtype tensors is an fp32 op rounded
once to the act dtype, sigmoid and silu are computed in fp32 from the act-dtype input and
rounded once (torch's bf16 ops on CUDA and CPU do that too).

Every op takes `impl` as `rlt_models.fused_ops` does ("auto" / "triton" / "torch"). The "torch"
references are the eager layer's expressions on the same tensors: bit-identical. The kernels
(`ngpt_kernels.py`, imported lazily) round at the same places; they differ by the order of the
fp32 sum of squares and by fast exp / sqrt (tests/test_ngpt_ops.py bounds each op).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from rlt_models import fused_ops
from rlt_models.layers import apply_rotary

UNIT_NORM_EPS = 1e-6  # transformers' DoryL2Norm default

_kernels: ModuleType | None = None


def _triton_kernels(impl: str, tensor: torch.Tensor) -> ModuleType | None:
    """`ngpt_kernels` when `impl` resolves to "triton" for `tensor`, None for "torch" (the
    resolution and its errors are `fused_ops.resolve_impl`'s)."""
    global _kernels
    if fused_ops.resolve_impl(impl, tensor) == "torch":
        return None
    if _kernels is None:
        _kernels = importlib.import_module("rlt_models.ngpt_kernels")
    return _kernels


# ---------------------------------------------------------------------------------------------
# torch references (the eager layer's numerics)


def unit_reference(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fp32 statistics and product), cast back."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + UNIT_NORM_EPS)).to(x.dtype)


def qk_heads(
    qkvg: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the packed projection [N, (2 H + 2 Hkv) D] (order q, k, v, gate): q [N, H, D],
    k and v [N, Hkv, D], gate [N, H D]."""
    n, q_size, kv_size = qkvg.shape[0], heads * head_dim, kv_heads * head_dim
    q, k, v, gate = qkvg.split((q_size, kv_size, kv_size, q_size), dim=-1)
    return (
        q.view(n, heads, head_dim),
        k.view(n, kv_heads, head_dim),
        v.view(n, kv_heads, head_dim),
        gate,
    )


# ---------------------------------------------------------------------------------------------
# dispatching ops. Inputs [N, width] address rows by their stride (the last dim contiguous);
# outputs are fresh contiguous tensors in the inputs' dtype unless the op says otherwise.


def unit_norm(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """unit(x) [N, d] (one kernel instead of cast, pow, sum, add, rsqrt, mul, cast)."""
    kernels = _triton_kernels(impl, x)
    return unit_reference(x) if kernels is None else kernels.unit_norm(x)


def unit_add_unit(h: torch.Tensor, other: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """unit(unit(h) + other) [N, d]: a loop's input h = unit(h) + inject, unit-normed as the
    first layer reads it (the sum itself is not kept: the layer reads only its unit)."""
    kernels = _triton_kernels(impl, h)
    if kernels is None:
        return unit_reference(unit_reference(h) + other)
    return kernels.unit_add_unit(h, other)


def qk_unit_rope_scale_(
    qkvg: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_scale: torch.Tensor,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on the packed projection qkvg [N, (2 H + 2 Hkv) D] (q, k, v, gate): each q and
    k head unit-normed, rotated by cos/sin [N, D] (split-half, `apply_rotary`), q multiplied by
    `q_scale` [H D]. Returns the views q [N, H, D] and k [N, Hkv, D]; v and gate untouched."""
    kernels = _triton_kernels(impl, qkvg)
    q, k, _, _ = qk_heads(qkvg, heads, kv_heads, head_dim)
    if kernels is None:
        rotated_q = apply_rotary(unit_reference(q), cos, sin) * q_scale.view(heads, head_dim)
        rotated_k = apply_rotary(unit_reference(k), cos, sin)
        q.copy_(rotated_q)
        k.copy_(rotated_k)
    else:
        kernels.qk_unit_rope_scale_(qkvg, cos, sin, heads, kv_heads, head_dim, q_scale)
    return q, k


def gated_unit(
    out: torch.Tensor, gate: torch.Tensor, gate_scale: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """unit(out * sigmoid(gate * gate_scale)) [N, H D]: the attention output's gate and the o
    projection's input norm; gate_scale [H D] is (s_gate * its scale)^2."""
    kernels = _triton_kernels(impl, out)
    if kernels is None:
        return unit_reference(out * torch.sigmoid(gate * gate_scale))
    return kernels.gated_unit(out, gate, gate_scale)


def unit_interpolate(
    x: torch.Tensor, raw: torch.Tensor, rate: torch.Tensor, *, keep_h: bool, impl: str = "auto"
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(h, unit(h)) with h = x + rate * (unit(raw) - x): x [N, d] the sublayer's unit input,
    raw [N, d] its projection's output, rate [d] = |lambda * its scale|. With keep_h False the
    Triton kernel does not write h and None comes back in its place (the caller needs only
    unit(h))."""
    kernels = _triton_kernels(impl, x)
    if kernels is None:
        h = x + rate * (unit_reference(raw) - x)
        return (h if keep_h else None), unit_reference(h)
    return kernels.unit_interpolate(x, raw, rate, keep_h)


def scaled_silu_unit(
    gate_up: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    intermediate_size: int,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """gate_up [N, 2F] (gate, then up) -> unit(silu(gate * gate_scale) * (up * up_scale))
    [N, F]: the nGPT MLP's activation and the down projection's input norm."""
    kernels = _triton_kernels(impl, gate_up)
    if kernels is None:
        gate, up = gate_up.split(intermediate_size, dim=-1)
        return unit_reference(F.silu(gate * gate_scale) * (up * up_scale))
    return kernels.scaled_silu_unit(gate_up, gate_scale, up_scale, intermediate_size)
