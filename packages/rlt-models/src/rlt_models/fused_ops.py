"""Fused elementwise ops of the Ouro layer: a torch reference and a Triton kernel for each
(README.md, "Fused decode path": the layer's sequence of ops, `impl` and the measurements).

Numerics (ouro-model-spec.md 3.3-3.5, identical to the eager modules in `layers.py`):
- `rms_norm`: fp32 mean of squares, x * rsqrt(ms + eps) in fp32, cast to x's dtype, then
  weight * that in x's dtype (fp32 product rounded once, as torch's bf16 mul does).
- `add_rms_norm`: residual + rms_norm(delta) added in act dtype (or + delta itself, for pre-norm
  layers), then rms_norm of the rounded sum.
- `rotary_qk_`: split-half RoPE on the q and k heads of the packed qkv projection, in place; each
  product rounded to act dtype, then the sum rounded (`apply_rotary`).
- `silu_mul`: silu(gate) rounded to act dtype, times up, rounded (`F.silu(gate) * up`).
- `exit_gate`: sigmoid(h . w + b) in fp32 from the act-dtype state (the eager gate's
  `sigmoid(F.linear(h.float(), w, b))`; the kernel's dot sums in its own order).
The kernels (`fused_kernels.py`, imported lazily) agree with the references up to the order of
the fp32 mean-of-squares sum and fast exp/sqrt: equal in most elements, at most an ulp apart.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from rlt_models.layers import apply_rotary

IMPLS = ("auto", "triton", "torch")

_kernels: ModuleType | None = None
_kernels_error: str | None = None


def _load_kernels() -> ModuleType | None:
    """Import `fused_kernels` once (this decorates the kernels); None when Triton is missing."""
    global _kernels, _kernels_error
    if _kernels is None and _kernels_error is None:
        try:
            _kernels = importlib.import_module("rlt_models.fused_kernels")
        except ImportError as exc:  # triton is a linux-only dependency
            _kernels_error = f"triton not importable ({exc})"
    return _kernels


def triton_unavailable_reason() -> str | None:
    """None when the Triton kernels import; otherwise why not."""
    _load_kernels()
    return _kernels_error


def resolve_impl(impl: str, tensor: torch.Tensor) -> str:
    """ "triton" or "torch" for `impl` applied to `tensor`: "auto" is Triton for a CUDA tensor
    when Triton imports; "triton" takes CPU tensors only when TRITON_INTERPRET=1 was set before
    the first Triton call (tests)."""
    if impl == "auto":
        return "triton" if tensor.is_cuda and _load_kernels() is not None else "torch"
    if impl == "triton":
        if _load_kernels() is None:
            raise RuntimeError(f"impl='triton' requested but {_kernels_error}")
        return impl
    if impl == "torch":
        return impl
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# ---------------------------------------------------------------------------------------------
# torch references (the eager model's numerics)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary_qk_reference_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    rotated = qkv[:, : (num_heads + num_kv_heads) * head_dim]
    heads = rotated.view(qkv.shape[0], num_heads + num_kv_heads, head_dim)
    heads.copy_(apply_rotary(heads, cos, sin))
    return qkv


# ---------------------------------------------------------------------------------------------
# dispatching ops


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto"
) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim; x [N, d], weight [d]; output in x's dtype."""
    if resolve_impl(impl, x) == "torch":
        return rms_norm_reference(x, weight, eps)
    return _kernels.rms_norm(x, weight, eps)


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    delta_weight: torch.Tensor | None,
    out_weight: torch.Tensor,
    eps: float,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_residual, normed) [N, d]: new_residual = residual + rms_norm(delta, delta_weight)
    (residual + delta when delta_weight is None: a pre-norm layer), normed =
    rms_norm(new_residual, out_weight). Fresh tensors; the inputs are not modified."""
    if resolve_impl(impl, residual) == "triton":
        return _kernels.add_rms_norm(residual, delta, delta_weight, out_weight, eps)
    if delta_weight is not None:
        delta = rms_norm_reference(delta, delta_weight, eps)
    new_residual = residual + delta
    return new_residual, rms_norm_reference(new_residual, out_weight, eps)


def rotary_qk_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Rotate, in place, the q heads and k heads of qkv [N, (H + 2 Hkv) * D] (q, then k, then v
    heads; v untouched) by cos/sin [N, D] in qkv's dtype. Returns qkv."""
    if resolve_impl(impl, qkv) == "torch":
        return rotary_qk_reference_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    return _kernels.rotary_qk_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def silu_mul(gate_up: torch.Tensor, intermediate_size: int, *, impl: str = "auto") -> torch.Tensor:
    """gate_up [N, 2F] (gate, then up) -> silu(gate) * up [N, F] in gate_up's dtype."""
    if resolve_impl(impl, gate_up) == "triton":
        return _kernels.silu_mul(gate_up, intermediate_size)
    gate, up = gate_up.split(intermediate_size, dim=-1)
    return F.silu(gate) * up


def exit_gate(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """hidden [N, d] (act dtype), weight [d] and bias [1] fp32 -> sigmoid(h . w + b) [N] fp32:
    one kernel instead of a cast, a GEMV and a sigmoid."""
    if resolve_impl(impl, hidden) == "triton":
        return _kernels.exit_gate(hidden, weight, bias)
    return torch.sigmoid(F.linear(hidden.float(), weight[None, :], bias).squeeze(-1))
