"""Triton kernels of the nGPT layer's fused ops (see `rlt_models.ngpt_ops` for the API and the
numerics).

Imported lazily by `ngpt_ops` on first Triton use (as `fused_kernels` is by `fused_ops`), so
tests can set TRITON_INTERPRET=1 before the first forced Triton call. Each kernel computes in
fp32 and rounds to the activation dtype (`ACT`, the output's dtype) exactly where eager torch
rounds; compiled without mul+add contraction (`fused_kernels.NO_FMA`: an FMA would skip the
product's rounding). A unit norm needs its whole row, so the row-wise kernels run one program
per row holding the row in registers (width up to 8,192 at the release shape's intermediate
7,168: 16 values per thread at 16 warps). Rows are addressed through their stride; the last dim
must be contiguous. Launched with programmatic dependent launch where `grid_dependency` says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from rlt_contracts.dependent_launch import launch_options

from rlt_models import grid_dependency
from rlt_models.fused_kernels import INTERPRETED, NO_FMA, launch_rows
from rlt_models.grid_dependency import wait_for_prior_grid
from rlt_models.ngpt_ops import UNIT_NORM_EPS


@triton.jit
def _round(x, ACT: tl.constexpr):
    """x (fp32) rounded to the act dtype, back in fp32 (an act-dtype tensor as torch holds it)."""
    return x.to(ACT).to(tl.float32)


@triton.jit
def _unit(x, eps):
    """unit(x) of a whole fp32 row (masked lanes hold 0), in fp32; the caller rounds."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 0) + eps))


@triton.jit
def _unit_norm_kernel(
    x_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    act = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, _unit(x, eps).to(act), mask=mask)


@triton.jit
def _unit_add_unit_kernel(
    h_ptr,
    other_ptr,
    out_ptr,
    stride_h,
    stride_other,
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
    act: tl.constexpr = out_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    other = tl.load(other_ptr + row * stride_other + offs, mask=mask, other=0.0).to(tl.float32)
    total = _round(_round(_unit(h, eps), act) + other, act)  # unit(h) + other, rounded twice
    tl.store(out_ptr + row * stride_out + offs, _unit(total, eps).to(act), mask=mask)


@triton.jit
def _qk_unit_rope_scale_kernel(
    qkvg_ptr,
    cos_ptr,
    sin_ptr,
    q_scale_ptr,  # [H * D]
    stride_qkvg,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_rotated_heads,  # q heads then k heads, consecutive D-sized chunks at the row's start
    eps,
    HALF: tl.constexpr,  # D // 2
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
    act: tl.constexpr = qkvg_ptr.dtype.element_ty
    first = qkvg_ptr + row * stride_qkvg + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # unit norm of each head (both halves), rounded to act dtype as `unit` returns it
    inv = 1.0 / tl.sqrt(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + eps)
    u1 = _round(x1 * inv[:, None], act)
    u2 = _round(x2 * inv[:, None], act)
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_sin
    cos1 = tl.load(cos_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    # x*cos + rot(x)*sin with rot(x) = (-x2, x1): each product rounded, then the sum (apply_rotary)
    out1 = _round(_round(u1 * cos1, act) - _round(u2 * sin1, act), act)
    out2 = _round(_round(u2 * cos2, act) + _round(u1 * sin2, act), act)
    # q heads times q_scale (rounded); k heads times 1.0, which is exact
    is_q = mask & (heads < num_q_heads)[:, None]
    scale_at = q_scale_ptr + heads[:, None] * (2 * HALF) + offs[None, :]
    scale1 = tl.load(scale_at, mask=is_q, other=1.0).to(tl.float32)
    scale2 = tl.load(scale_at + HALF, mask=is_q, other=1.0).to(tl.float32)
    tl.store(first, (out1 * scale1).to(act), mask=mask)
    tl.store(first + HALF, (out2 * scale2).to(act), mask=mask)


@triton.jit
def _gated_unit_kernel(
    out_ptr,
    gate_ptr,
    gate_scale_ptr,
    result_ptr,
    stride_out,
    stride_gate,
    stride_result,
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
    act: tl.constexpr = result_ptr.dtype.element_ty
    out = tl.load(out_ptr + row * stride_out + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(gate_scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    logit = _round(gate * scale, act)
    gated = _round(out * _round(1.0 / (1.0 + tl.exp(-logit)), act), act)
    tl.store(result_ptr + row * stride_result + offs, _unit(gated, eps).to(act), mask=mask)


@triton.jit
def _unit_interpolate_kernel(
    x_ptr,
    raw_ptr,
    rate_ptr,
    h_ptr,
    y_ptr,
    stride_x,
    stride_raw,
    stride_h,
    stride_y,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    KEEP_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    act: tl.constexpr = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    raw = tl.load(raw_ptr + row * stride_raw + offs, mask=mask, other=0.0).to(tl.float32)
    rate = tl.load(rate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    step = _round(rate * _round(_round(_unit(raw, eps), act) - x, act), act)
    h = _round(x + step, act)  # masked lanes: 0
    if KEEP_H:
        tl.store(h_ptr + row * stride_h + offs, h.to(act), mask=mask)
    tl.store(y_ptr + row * stride_y + offs, _unit(h, eps).to(act), mask=mask)


@triton.jit
def _scaled_silu_unit_kernel(
    gate_up_ptr,
    gate_scale_ptr,
    up_scale_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    n_cols,  # intermediate size F; gate is columns [0, F), up [F, 2F)
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    act: tl.constexpr = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * stride_gate_up
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    gate_scale = tl.load(gate_scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up_scale = tl.load(up_scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled_gate = _round(gate * gate_scale, act)
    silu = _round(scaled_gate / (1.0 + tl.exp(-scaled_gate)), act)
    product = _round(silu * _round(up * up_scale, act), act)
    tl.store(out_ptr + row * stride_out + offs, _unit(product, eps).to(act), mask=mask)


def _check(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                f"the Triton nGPT ops need CUDA tensors, got {tensor.device} (set "
                "TRITON_INTERPRET=1 before the first Triton call to run them on CPU)"
            )
        if tensor.dim() >= 1 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError("the Triton nGPT ops need a contiguous last dim")


def _row_launch(kernel, rows: int, width: int, *args, pdl: bool, **constants) -> None:
    """`fused_kernels.launch_rows` with the row's width and the unit norm's eps as the last
    arguments."""
    launch_rows(kernel, rows, width, *args, width, UNIT_NORM_EPS, pdl=pdl, **constants)


def _empty_rows(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return torch.empty((rows, width), dtype=like.dtype, device=like.device)


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    rows, width = x.shape
    out = _empty_rows(x, rows, width)
    if rows:
        pdl = grid_dependency.enabled(x)
        _row_launch(_unit_norm_kernel, rows, width, x, out, x.stride(0), out.stride(0), pdl=pdl)
    return out


def unit_add_unit(h: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    _check(h, other)
    rows, width = h.shape
    out = _empty_rows(h, rows, width)
    if rows:
        pdl = grid_dependency.enabled(h)
        strides = (h.stride(0), other.stride(0), out.stride(0))
        _row_launch(_unit_add_unit_kernel, rows, width, h, other, out, *strides, pdl=pdl)
    return out


def qk_unit_rope_scale_(qkvg, cos, sin, heads, kv_heads, head_dim, q_scale) -> None:
    _check(qkvg, cos, sin, q_scale)
    rows, rotated = qkvg.shape[0], heads + kv_heads
    if not rows:
        return
    pdl = grid_dependency.enabled(qkvg)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    # a few heads a program: at one row the release shape (20 heads of 256) runs 10 programs
    block_h = min(triton.next_power_of_2(rotated), max(1, 256 // block_half))
    _qk_unit_rope_scale_kernel[(rows, triton.cdiv(rotated, block_h))](
        qkvg,
        cos,
        sin,
        q_scale,
        qkvg.stride(0),
        cos.stride(0),
        sin.stride(0),
        heads,
        rotated,
        UNIT_NORM_EPS,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        num_warps=4,
        USE_PDL=pdl,
        **NO_FMA,
        **launch_options(pdl),
    )


def gated_unit(out: torch.Tensor, gate: torch.Tensor, gate_scale: torch.Tensor) -> torch.Tensor:
    _check(out, gate, gate_scale)
    rows, width = out.shape
    result = _empty_rows(out, rows, width)
    if rows:
        pdl = grid_dependency.enabled(out)
        strides = (out.stride(0), gate.stride(0), result.stride(0))
        _row_launch(
            _gated_unit_kernel, rows, width, out, gate, gate_scale, result, *strides, pdl=pdl
        )
    return result


def unit_interpolate(x, raw, rate, keep_h: bool):
    _check(x, raw, rate)
    rows, width = x.shape
    y = _empty_rows(x, rows, width)
    h = _empty_rows(x, rows, width) if keep_h else None
    if rows:
        pdl = grid_dependency.enabled(x)
        h_arg = y if h is None else h  # not written without KEEP_H
        strides = (x.stride(0), raw.stride(0), h_arg.stride(0), y.stride(0))
        _row_launch(
            _unit_interpolate_kernel, rows, width, x, raw, rate, h_arg, y, *strides,
            pdl=pdl, KEEP_H=keep_h,
        )  # fmt: skip
    return h, y


def scaled_silu_unit(gate_up, gate_scale, up_scale, intermediate_size: int) -> torch.Tensor:
    _check(gate_up, gate_scale, up_scale)
    rows = gate_up.shape[0]
    out = _empty_rows(gate_up, rows, intermediate_size)
    if rows:
        pdl = grid_dependency.enabled(gate_up)
        _row_launch(
            _scaled_silu_unit_kernel, rows, intermediate_size, gate_up, gate_scale, up_scale,
            out, gate_up.stride(0), out.stride(0), pdl=pdl,
        )  # fmt: skip
    return out
