"""Triton kernels of the fused Ouro layer ops (see `rlt_models.fused_ops` for the API and numerics)
and the row helpers that `ngpt_kernels` shares.

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
def row_start(n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """(row, column offsets, mask) of a one-program-a-row kernel, after the previous grid when
    launched with PDL."""
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    return row, offs, offs < n_cols


@triton.jit
def load_row(ptr, row, stride, offs, mask):
    """A row of a [N, n_cols] tensor in fp32 (masked lanes 0)."""
    return tl.load(ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def round_act(x, ACT: tl.constexpr):
    """x (fp32) rounded to the act dtype, back in fp32 (an act-dtype tensor as torch holds it)."""
    return x.to(ACT).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    x = load_row(x_ptr, row, stride_x, offs, mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = round_act(x * inv_rms, out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + row * stride_out + offs
    tl.store(out_row, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


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
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    act = new_residual_ptr.dtype.element_ty
    delta = load_row(delta_ptr, row, stride_delta, offs, mask)
    if NORM_DELTA:
        # rms_norm(delta, delta_weight), rounded to act dtype at the same two places as RMSNorm.
        inv_rms = 1.0 / tl.sqrt(tl.sum(delta * delta, 0) / n_cols + eps)
        delta = round_act(delta * inv_rms, act)
        delta_weight = tl.load(delta_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        delta = round_act(delta_weight * delta, act)
    # residual add in act dtype
    residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
    new_residual = (residual.to(tl.float32) + delta).to(act)
    tl.store(new_residual_ptr + row * stride_new_residual + offs, new_residual, mask=mask)
    # rms_norm(new_residual, out_weight) of the rounded residual
    x = new_residual.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = round_act(x * inv_rms, act)
    out_weight = tl.load(out_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * stride_normed + offs, (out_weight * normed).to(act), mask=mask)


@triton.jit
def _rope_table_row(cos_ptr, sin_ptr, row, stride_cos, stride_sin, offs, dim_valid, HALF):
    """cos1, cos2, sin1, sin2: the two halves of a row's cos and sin, fp32 [1, BLOCK_HALF]."""
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_sin
    cos1 = tl.load(cos_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF + offs, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_scale_ptr,  # [H * D], read with UNIT_SCALE only
    stride_qkv,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_rotated_heads,  # q heads then k heads, consecutive D-sized chunks at the row's start
    eps,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_H: tl.constexpr,  # heads per program
    UNIT_SCALE: tl.constexpr,  # nGPT: unit-norm each head before RoPE, times q_scale after
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    dim_valid = offs < HALF
    mask = (heads < num_rotated_heads)[:, None] & dim_valid[None, :]
    act: tl.constexpr = qkv_ptr.dtype.element_ty
    table = (cos_ptr, sin_ptr, row, stride_cos, stride_sin, offs, dim_valid, HALF)
    if not UNIT_SCALE:  # each variant loads the table where its own kernel did (same PTX)
        cos1, cos2, sin1, sin2 = _rope_table_row(*table)
    first = qkv_ptr + row * stride_qkv + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if UNIT_SCALE:  # unit norm of each head (both halves), rounded as `unit` returns it
        inv = 1.0 / tl.sqrt(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + eps)
        x1 = round_act(x1 * inv[:, None], act)
        x2 = round_act(x2 * inv[:, None], act)
        cos1, cos2, sin1, sin2 = _rope_table_row(*table)
    # x*cos + rot(x)*sin with rot(x) = (-x2, x1): each product rounded, then the sum rounded
    # (here before the q scale, else at the store)
    out1 = round_act(x1 * cos1, act) - round_act(x2 * sin1, act)
    if UNIT_SCALE:
        out1 = round_act(out1, act)
    out2 = round_act(x2 * cos2, act) + round_act(x1 * sin2, act)
    if UNIT_SCALE:
        out2 = round_act(out2, act)
    if UNIT_SCALE:  # q heads times q_scale (rounded); k heads times 1.0, which is exact
        is_q = mask & (heads < num_q_heads)[:, None]
        scale_at = q_scale_ptr + heads[:, None] * (2 * HALF) + offs[None, :]
        scale1 = tl.load(scale_at, mask=is_q, other=1.0).to(tl.float32)
        scale2 = tl.load(scale_at + HALF, mask=is_q, other=1.0).to(tl.float32)
        tl.store(first, (out1 * scale1).to(act), mask=mask)
        tl.store(first + HALF, (out2 * scale2).to(act), mask=mask)
    else:
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
    silu = round_act(gate / (1.0 + tl.exp(-gate)), act)
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
    row, offs, mask = row_start(n_cols, BLOCK, USE_PDL)
    h = load_row(hidden_ptr, row, stride_hidden, offs, mask)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    logit = tl.sum(h * weight, 0) + tl.load(bias_ptr)
    tl.store(out_ptr + row, 1.0 / (1.0 + tl.exp(-logit)))


def check_device(*tensors: torch.Tensor) -> None:
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


def empty_rows(like: torch.Tensor, width: int) -> torch.Tensor:
    """A fresh contiguous [rows of `like`, width] tensor in `like`'s dtype and device."""
    return torch.empty((like.shape[0], width), dtype=like.dtype, device=like.device)


def launch_rows(kernel, width: int, *args, **constants) -> None:
    """`kernel` over one program a row of args[0] ([rows, ...]; PDL as its device takes it),
    each row of `width` columns in registers. No launch without rows."""
    rows = args[0].shape[0]
    if rows:
        block = triton.next_power_of_2(width)
        pdl = grid_dependency.enabled(args[0])
        kernel[(rows,)](
            *args,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
            USE_PDL=pdl,
            **constants,
            **NO_FMA,
            **launch_options(pdl),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, d] -> weight * rms_norm(x) [N, d] in x's dtype (one program per row)."""
    check_device(x, weight)
    d = x.shape[1]
    out = empty_rows(x, d)
    launch_rows(_rms_norm_kernel, d, x, weight, out, x.stride(0), out.stride(0), d, eps)
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
    check_device(residual, delta, out_weight, *([delta_weight] if norm_delta else []))
    d = residual.shape[1]
    new_residual = empty_rows(residual, d)
    normed = torch.empty_like(new_residual)
    delta_weight = delta_weight if norm_delta else out_weight  # not read without NORM_DELTA
    strides = (residual.stride(0), delta.stride(0), new_residual.stride(0), normed.stride(0))
    launch_rows(
        _add_rms_norm_kernel, d, residual, delta, delta_weight, out_weight, new_residual, normed,
        *strides, d, eps, NORM_DELTA=norm_delta,
    )  # fmt: skip
    return new_residual, normed


def rotary_qk_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_scale: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Rotate the q and k heads of qkv [N, (H + 2 Hkv) * D] in place; returns qkv. With
    `q_scale` [H D] (the nGPT layer's `qk_unit_rope_scale_`), each head is unit-normed (`eps`)
    before RoPE and the q heads are multiplied by q_scale after it."""
    check_device(qkv, cos, sin, *([] if q_scale is None else [q_scale]))
    num_rows, rotated_heads = qkv.shape[0], num_heads + num_kv_heads
    if num_rows == 0:
        return qkv
    pdl = grid_dependency.enabled(qkv)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    # elements a program: with the unit norm fewer, so that at one row the nGPT release shape
    # (20 heads of 256) runs 10 programs
    budget = 1024 if q_scale is None else 256
    block_h = min(triton.next_power_of_2(rotated_heads), max(1, budget // block_half))
    _rotary_qk_kernel[(num_rows, triton.cdiv(rotated_heads, block_h))](
        qkv, cos, sin, qkv if q_scale is None else q_scale, qkv.stride(0), cos.stride(0),
        sin.stride(0), num_heads, rotated_heads, eps, HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, UNIT_SCALE=q_scale is not None, num_warps=4, USE_PDL=pdl, **NO_FMA,
        **launch_options(pdl),
    )  # fmt: skip
    return qkv


def silu_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """gate_up [N, 2F] (gate first) -> silu(gate) * up [N, F]."""
    check_device(gate_up)
    out = empty_rows(gate_up, intermediate_size)
    if gate_up.shape[0] == 0:
        return out
    pdl = grid_dependency.enabled(gate_up)
    block = min(1024, triton.next_power_of_2(intermediate_size))
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(intermediate_size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), intermediate_size, BLOCK=block,
        num_warps=4, USE_PDL=pdl, **NO_FMA, **launch_options(pdl),
    )  # fmt: skip
    return out


def exit_gate(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid(hidden . weight + bias) [N] fp32; hidden [N, d], weight [d] / bias [1] fp32."""
    check_device(hidden, weight, bias)
    d = hidden.shape[1]
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    launch_rows(_exit_gate_kernel, d, hidden, weight, bias, out, hidden.stride(0), d)
    return out
