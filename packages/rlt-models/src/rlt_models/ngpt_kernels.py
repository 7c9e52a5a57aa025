"""Triton kernels of the nGPT layer's fused ops (see `rlt_models.ngpt_ops` for the API and the
numerics).

Imported lazily by `ngpt_ops` on first Triton use (as `fused_kernels` is by `fused_ops`), so
tests can set TRITON_INTERPRET=1 before the first forced Triton call. Each kernel computes in
fp32 and rounds to the activation dtype (the output's dtype) exactly where eager torch rounds;
compiled without mul+add contraction (`fused_kernels.NO_FMA`: an FMA would skip the product's
rounding). A unit norm needs its whole row, so the row-wise kernels run one program per row
holding the row in registers (width up to 8,192 at the release shape's intermediate 7,168: 16
values per thread at 16 warps). Rows are addressed through their stride; the last dim must be
contiguous. The row helpers, the launcher and the RoPE kernel (`rotary_qk_` with its unit-norm
and q-scale flag) are `fused_kernels`'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlt_models.fused_kernels import (
    check_device,
    empty_rows,
    launch_rows,
    load_row,
    rotary_qk_,
    row_start,
)
from rlt_models.fused_kernels import round_act as _round
from rlt_models.ngpt_ops import UNIT_NORM_EPS


@triton.jit
def _unit(x, eps):
    """unit(x) of a whole fp32 row (masked lanes hold 0), in fp32; the caller rounds."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 0) + eps))


@triton.jit
def _unit_norm_kernel(
    x_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    act = out_ptr.dtype.element_ty
    x = load_row(x_ptr, row, stride_x, offs, mask)
    tl.store(out_ptr + row * stride_out + offs, _unit(x, eps).to(act), mask=mask)


@triton.jit
def _unit_add_unit_kernel(
    h_ptr, other_ptr, out_ptr, stride_h, stride_other, stride_out, n_cols, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    act: tl.constexpr = out_ptr.dtype.element_ty
    h = load_row(h_ptr, row, stride_h, offs, mask)
    other = load_row(other_ptr, row, stride_other, offs, mask)
    total = _round(_round(_unit(h, eps), act) + other, act)  # unit(h) + other, rounded twice
    tl.store(out_ptr + row * stride_out + offs, _unit(total, eps).to(act), mask=mask)


@triton.jit
def _gated_unit_kernel(
    out_ptr, gate_ptr, gate_scale_ptr, result_ptr, stride_out, stride_gate, stride_result,
    n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    act: tl.constexpr = result_ptr.dtype.element_ty
    out = load_row(out_ptr, row, stride_out, offs, mask)
    gate = load_row(gate_ptr, row, stride_gate, offs, mask)
    scale = tl.load(gate_scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    logit = _round(gate * scale, act)
    gated = _round(out * _round(1.0 / (1.0 + tl.exp(-logit)), act), act)
    tl.store(result_ptr + row * stride_result + offs, _unit(gated, eps).to(act), mask=mask)


@triton.jit
def _unit_interpolate_kernel(
    x_ptr, raw_ptr, rate_ptr, h_ptr, y_ptr, stride_x, stride_raw, stride_h, stride_y, n_cols,
    eps, BLOCK: tl.constexpr, KEEP_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    act: tl.constexpr = y_ptr.dtype.element_ty
    x = load_row(x_ptr, row, stride_x, offs, mask)
    raw = load_row(raw_ptr, row, stride_raw, offs, mask)
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
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
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


def _row_launch(kernel, width: int, *args, **constants) -> None:
    """`fused_kernels.launch_rows` with the row's width and the unit norm's eps as the last
    arguments."""
    launch_rows(kernel, width, *args, width, UNIT_NORM_EPS, **constants)


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    check_device(x)
    out = empty_rows(x, x.shape[1])
    _row_launch(_unit_norm_kernel, x.shape[1], x, out, x.stride(0), out.stride(0))
    return out


def unit_add_unit(h: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    check_device(h, other)
    out = empty_rows(h, h.shape[1])
    strides = (h.stride(0), other.stride(0), out.stride(0))
    _row_launch(_unit_add_unit_kernel, h.shape[1], h, other, out, *strides)
    return out


def qk_unit_rope_scale_(qkvg, cos, sin, heads, kv_heads, head_dim, q_scale) -> None:
    rotary_qk_(qkvg, cos, sin, heads, kv_heads, head_dim, q_scale=q_scale, eps=UNIT_NORM_EPS)


def gated_unit(out: torch.Tensor, gate: torch.Tensor, gate_scale: torch.Tensor) -> torch.Tensor:
    check_device(out, gate, gate_scale)
    result = empty_rows(out, out.shape[1])
    strides = (out.stride(0), gate.stride(0), result.stride(0))
    _row_launch(_gated_unit_kernel, out.shape[1], out, gate, gate_scale, result, *strides)
    return result


def unit_interpolate(x, raw, rate, keep_h: bool):
    check_device(x, raw, rate)
    width = x.shape[1]
    y = empty_rows(x, width)
    h = empty_rows(x, width) if keep_h else None
    h_arg = y if h is None else h  # not written without KEEP_H
    strides = (x.stride(0), raw.stride(0), h_arg.stride(0), y.stride(0))
    _row_launch(_unit_interpolate_kernel, width, x, raw, rate, h_arg, y, *strides, KEEP_H=keep_h)
    return h, y


def scaled_silu_unit(gate_up, gate_scale, up_scale, intermediate_size: int) -> torch.Tensor:
    check_device(gate_up, gate_scale, up_scale)
    out = empty_rows(gate_up, intermediate_size)
    _row_launch(
        _scaled_silu_unit_kernel, intermediate_size, gate_up, gate_scale, up_scale, out,
        gate_up.stride(0), out.stride(0),
    )  # fmt: skip
    return out
