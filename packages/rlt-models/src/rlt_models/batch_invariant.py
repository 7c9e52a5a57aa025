"""Batch-invariant versions of the model's batch-sensitive ops (`OuroModel.batch_invariant`): a
row's output depends only on that row's input (and the weights), bitwise. README.md,
"Batch-invariant mode", says which plain torch ops break that and what replaces them here:
`linear` (on the CPU fixed blocks of `ROW_BLOCK` rows, the last zero-padded: on this 2-core CPU
an 8-row block costs about 2.7x a one-row GEMV and 1.3x a plain 8-row GEMM, bundled model's
shapes, bf16; on CUDA the fixed-tile Triton matmul, `fixed_row_blocks` where Triton is missing)
and `silu` / `sigmoid` (through `torch.exp` in fp32, rounded once, as `F.silu` on bf16 does).
The values differ from the default path by rounding (about 1 ulp per op): the mode is its own
numerics.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - linux wheels of torch bring triton
    triton = None

ROW_BLOCK = 8  # rows per GEMM call on the CPU: one call covers a decode batch of up to 8 rows
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def fixed_row_blocks(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T as ceil(M / ROW_BLOCK) GEMMs of shape [ROW_BLOCK, K] each."""
    rows, k = x.shape
    blocks = -(-rows // ROW_BLOCK)
    padded = x.new_zeros(blocks * ROW_BLOCK, k)
    padded[:rows] = x
    out = x.new_empty(blocks * ROW_BLOCK, weight.shape[0])
    weight_t = weight.t()
    for block in range(blocks):
        rows_of_block = slice(block * ROW_BLOCK, (block + 1) * ROW_BLOCK)
        torch.mm(padded[rows_of_block], weight_t, out=out[rows_of_block])
    return out[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant `F.linear` for x [..., K] (see the module doc); bias added row-wise."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        out = F.linear(flat, weight)
    elif _triton_eligible(flat, weight):
        out = triton_linear(flat, weight)
    else:
        out = fixed_row_blocks(flat, weight)
    if bias is not None:
        out = out + bias  # elementwise: row-invariant
    return out.reshape(*lead, weight.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in fp32 through `torch.exp`, rounded once to x's dtype."""
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in x's dtype (fp32 for the exit gate) through `torch.exp`."""
    return 1.0 / (1.0 + torch.exp(-x))


# -- CUDA: an M-tiled Triton matmul with a tile configuration that never depends on M ----------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); one configuration for every M.
TRITON_TILES = (64, 64, 64, 4, 3)


def _triton_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        triton is not None
        and x.is_cuda
        and not INTERPRETED
        and x.dtype == weight.dtype
        and weight.stride(1) == 1
    )


if triton is not None:
    # `rows` is not specialised: Triton would otherwise compile different variants for M == 1
    # or M % 16 == 0, and the kernel must be one program for every M.
    @triton.jit(do_not_specialize=["rows"])
    def _fixed_tile_linear_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        rows,
        n,
        k,
        stride_x,
        stride_w,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < rows
        col_ok = offs_n < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):  # one K order for every row: no split-K
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            x = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if IEEE:  # fp32 weights: no TF32
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(
            out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def triton_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T with `_fixed_tile_linear_kernel` (CUDA, or the interpreter)."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = TRITON_TILES
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _fixed_tile_linear_kernel[grid](
        x,
        weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
    )
    return out
