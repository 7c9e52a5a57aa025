"""Triton kernels of the fused Ouro layer ops (see `rlt_models.fused_ops` for the API and numerics).

Imported lazily by `fused_ops` on first Triton use, never by `import rlt_models`: Triton decides
at decoration time whether a kernel runs compiled or in its CPU interpreter, so tests can set
TRITON_INTERPRET=1 any time before the first forced Triton call.

Every kernel computes in fp32 and rounds to the activation dtype exactly where the eager model
does (each elementwise product / sum of two act-dtype tensors is an fp32 op rounded once, like
torch's bf16/fp16 ops). Kernels are compiled with `enable_fp_fusion=False`: otherwise LLVM may
narrow `round(round(a*b) + c)` to bf16 ops and contract them into one bf16 FMA (seen on an H200),
which skips the product's rounding that eager torch does. Rows are addressed through their
stride; the last dim must be contiguous.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from rlt_contracts.dependent_launch import launch_options

from rlt_models import grid_dependency
from rlt_models.grid_dependency import wait_for_prior_grid

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _add_rms_norm_kernel(
    residual_ptr,
    delta_ptr,
    delta_weight_ptr,
    out_weight_ptr,
    new_residual_ptr,
    normed_ptr,
    stride_residual,
    stride_delta,
    stride_new_residual,
    stride_normed,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    NORM_DELTA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    act = new_residual_ptr.dtype.element_ty
    delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM_DELTA:
        # rms_norm(delta, delta_weight), rounded to act dtype at the same two places as RMSNorm.
        inv_rms = 1.0 / tl.sqrt(tl.sum(delta * delta, 0) / n_cols + eps)
        delta = (delta * inv_rms).to(act).to(tl.float32)
        delta_weight = tl.load(delta_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        delta = (delta_weight * delta).to(act).to(tl.float32)
    # residual add in act dtype
    residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
    new_residual = (residual.to(tl.float32) + delta).to(act)
    tl.store(new_residual_ptr + row * stride_new_residual + offs, new_residual, mask=mask)
    # rms_norm(new_residual, out_weight) of the rounded residual
    x = new_residual.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * inv_rms).to(act).to(tl.float32)
    out_weight = tl.load(out_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * stride_normed + offs, (out_weight * normed).to(act), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    num_rotated_heads,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_H: tl.constexpr,  # heads per program
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    dim_valid = offs < HALF
    mask = (heads < num_rotated_heads)[:, None] & dim_valid[None, :]
    act = qkv_ptr.dtype.element_ty
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_sin
    cos1 = tl.load(cos_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    # q heads then k heads are consecutive head_dim-sized chunks at the start of the row
    first = qkv_ptr + row * stride_qkv + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x*cos + rot(x)*sin with rot(x) = (-x2, x1): each product rounded, then the sum rounded
    out1 = (x1 * cos1).to(act).to(tl.float32) - (x2 * sin1).to(act).to(tl.float32)
    out2 = (x2 * cos2).to(act).to(tl.float32) + (x1 * sin2).to(act).to(tl.float32)
    tl.store(first, out1.to(act), mask=mask)
    tl.store(first + HALF, out2.to(act), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    n_cols,  # intermediate size F; gate is columns [0, F), up [F, 2F)
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    act = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * stride_gate_up
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(act), mask=mask)


@triton.jit
def _exit_gate_kernel(
    hidden_ptr,
    weight_ptr,  # [d] fp32
    bias_ptr,  # [1] fp32
    out_ptr,  # [N] fp32
    stride_hidden,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(hidden_ptr + row * stride_hidden + offs, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    logit = tl.sum(h * weight, 0) + tl.load(bias_ptr)
    tl.store(out_ptr + row, 1.0 / (1.0 + tl.exp(-logit)))


def _check_device(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                f"the Triton fused ops need CUDA tensors, got {tensor.device} (set "
                "TRITON_INTERPRET=1 before the first Triton call to run them on CPU)"
            )
        if tensor.dim() >= 1 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError("the Triton fused ops need a contiguous last dim")


# Compile option of every launch here (see the module doc): no mul+add contraction.
NO_FMA = {"enable_fp_fusion": False}


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def launch_rows(kernel, rows: int, width: int, *args, pdl: bool, **constants) -> None:
    """`kernel` over `rows` programs, one a row of `width` columns (the row in registers)."""
    block = triton.next_power_of_2(width)
    kernel[(rows,)](
        *args,
        BLOCK=block,
        num_warps=_row_warps(block),
        USE_PDL=pdl,
        **constants,
        **NO_FMA,
        **launch_options(pdl),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, d] -> weight * rms_norm(x) [N, d] in x's dtype (one program per row)."""
    _check_device(x, weight)
    num_rows, d = x.shape
    out = torch.empty((num_rows, d), dtype=x.dtype, device=x.device)
    if num_rows:
        strides = (x.stride(0), out.stride(0))
        pdl = grid_dependency.enabled(x)
        launch_rows(_rms_norm_kernel, num_rows, d, x, weight, out, *strides, d, eps, pdl=pdl)
    return out


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    delta_weight: torch.Tensor | None,
    out_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + rms_norm(delta) * delta_weight, rms_norm(that) * out_weight), both [N, d];
    with delta_weight None the delta is added as it is (a pre-norm layer's residual add)."""
    norm_delta = delta_weight is not None
    _check_device(residual, delta, out_weight, *([delta_weight] if norm_delta else []))
    num_rows, d = residual.shape
    new_residual = torch.empty((num_rows, d), dtype=residual.dtype, device=residual.device)
    normed = torch.empty_like(new_residual)
    if num_rows:
        if not norm_delta:
            delta_weight = out_weight  # a placeholder: not read without NORM_DELTA
        strides = (residual.stride(0), delta.stride(0), new_residual.stride(0), normed.stride(0))
        launch_rows(
            _add_rms_norm_kernel, num_rows, d, residual, delta, delta_weight, out_weight,
            new_residual, normed, *strides, d, eps, pdl=grid_dependency.enabled(residual),
            NORM_DELTA=norm_delta,
        )  # fmt: skip
    return new_residual, normed


def rotary_qk_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Rotate the q and k heads of qkv [N, (H + 2 Hkv) * D] in place; returns qkv."""
    _check_device(qkv, cos, sin)
    pdl = grid_dependency.enabled(qkv)
    num_rows = qkv.shape[0]
    rotated_heads = num_heads + num_kv_heads
    if num_rows == 0:
        return qkv
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(rotated_heads), max(1, 1024 // block_half))
    grid = (num_rows, triton.cdiv(rotated_heads, block_h))
    _rotary_qk_kernel[grid](
        qkv,
        cos,
        sin,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        rotated_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        num_warps=4,
        USE_PDL=pdl,
        **NO_FMA,
        **launch_options(pdl),
    )
    return qkv


def silu_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """gate_up [N, 2F] (gate first) -> silu(gate) * up [N, F]."""
    _check_device(gate_up)
    pdl = grid_dependency.enabled(gate_up)
    num_rows = gate_up.shape[0]
    out = torch.empty((num_rows, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate_size))
    grid = (num_rows, triton.cdiv(intermediate_size, block))
    _silu_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        intermediate_size,
        BLOCK=block,
        num_warps=4,
        USE_PDL=pdl,
        **NO_FMA,
        **launch_options(pdl),
    )
    return out


def exit_gate(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid(hidden . weight + bias) [N] fp32; hidden [N, d], weight [d] / bias [1] fp32."""
    _check_device(hidden, weight, bias)
    num_rows, d = hidden.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
    if num_rows:
        pdl = grid_dependency.enabled(hidden)
        launch_rows(
            _exit_gate_kernel, num_rows, d, hidden, weight, bias, out, hidden.stride(0), d, pdl=pdl
        )
    return out
