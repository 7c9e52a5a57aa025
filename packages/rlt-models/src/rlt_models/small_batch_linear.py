"""`linear(x, weight)` for few rows: a Triton weight-streaming kernel where it is measured faster.

At batch 1 to 16 a projection is a matrix-vector product bounded by reading the weight once
(Ouro-1.4B: 2.47 GB per loop). cuBLAS reaches ~2.6 TB/s there on an H200, well under the
~4.3 TB/s a copy achieves. The kernels below stream the weight in [BLOCK_N, BLOCK_K] tiles with
several loads in flight per CTA and keep the few rows of x in a 16-row `tl.dot` tile (or, for
one row, in registers).

Selection is by measurement, never by assumption: the first call for a (rows bucket, N, K,
dtype) times cuBLAS and each kernel configuration on the device and remembers the fastest; a
shape where cuBLAS wins keeps cuBLAS. Each candidate is timed as a decode loop runs it: a CUDA
graph of one call per weight over enough random copies of the weight that together they exceed
twice the L2 cache (a loop's other layers evict each weight before its next use), median of
graph replays. Timed that way, the choices held in a whole loop (on an H200, Ouro-1.4B, batch 1:
the four projections 4-18% faster, the loop 9%; `benchmarks/small_batch_sweep.py` at 9d2bf4f);
an earlier single-call timing with a flushed L2 did not, and needed a 15% margin. Inside the
engine the copies are limited to a quarter of the memory left after the KV pool, so the timing
can run warmer, and near-ties have gone either way between runs (docs/results.md). The first
call must not run inside CUDA-graph capture (the engine's warm-up runs every decode shape eagerly
first). Only bf16/fp16 weights are considered (fp32 keeps cuBLAS, whose tests are exact against
fp64). Output equals cuBLAS up to the order of the fp32 accumulation (then one rounding to act
dtype).

On sm_90+ the kernels are launched with programmatic dependent launch (`grid_dependency`):
each CTA loads its first weight tile, then waits for the previous kernel, then reads x. With
`needed` (the LM head in a decode tick: "does any row exit?") a CTA waits first, and where the
flag is 0 writes zeros and reads no weight. (With PDL on, all four Ouro-1.4B projections chose
the Triton kernel at one row in each of the four H200 c1 profiles kept since.)
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rlt_contracts.dependent_launch import launch_options

from rlt_models import grid_dependency

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:  # pragma: no cover - linux wheels of torch bring triton
    triton = None

MAX_ROWS = 16
# A kernel must beat cuBLAS by this factor in the loop-like timing (replays vary by ~1%).
MARGIN = 0.97
# The timed weight copies together exceed this multiple of the L2 cache (at most 16 copies).
COLD_L2_FACTOR = 2
MAX_COPIES = 16
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class TileConfig:
    """single_row: the one-row kernel (no tensor cores, more CTAs: BLOCK_N may go down to 4)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    single_row: bool = False


CONFIGS = (
    TileConfig(16, 256, 4, 4),
    TileConfig(32, 256, 4, 4),
    TileConfig(16, 512, 4, 3),
    TileConfig(64, 128, 4, 4),
    TileConfig(32, 128, 4, 5),
    TileConfig(4, 512, 4, 4, single_row=True),
    TileConfig(8, 512, 4, 3, single_row=True),
    TileConfig(8, 256, 4, 4, single_row=True),
    TileConfig(16, 256, 8, 4, single_row=True),
    # fastest in the H200 sweep: one row, 2 output features per CTA over 1K-wide K steps (all
    # four Ouro-1.4B projections), and a 16-wide tile with a deep pipeline (qkv, 2-8 rows)
    TileConfig(2, 1024, 2, 3, single_row=True),
    TileConfig(16, 64, 2, 8),
)

if triton is not None:
    from rlt_models.grid_dependency import wait_for_prior_grid

    @triton.jit
    def _small_rows_linear_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        rows,
        n,
        k,
        stride_x,
        stride_w,
        stride_out,
        needed_ptr,  # int32 [1] (PREDICATED): 0 = write zeros, read no weight
        scale_ptr,  # fp32 [N] (SCALED): per-output-channel scales of an fp8 weight
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        PREDICATED: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        col_ok = offs_n < n
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        x_rows = x_ptr + offs_m[:, None] * stride_x
        out_tile = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
        out_mask = row_ok[:, None] & col_ok[None, :]
        if PREDICATED:  # the flag comes from the previous kernel: wait first
            if USE_PDL:
                wait_for_prior_grid()
            if tl.load(needed_ptr) == 0:
                tl.store(out_tile, tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty), out_mask)
                return
        # The first weight tile is loaded before waiting for the previous kernel (weights are
        # never written while the engine runs); x, which that kernel may produce, after.
        offs_k = tl.arange(0, BLOCK_K)
        w = tl.load(
            w_rows + offs_k[None, :], mask=col_ok[:, None] & (offs_k < k)[None, :], other=0.0
        )
        if USE_PDL and not PREDICATED:
            wait_for_prior_grid()
        x = tl.load(
            x_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k < k)[None, :], other=0.0
        )
        # an fp8 weight is widened to x's dtype in registers (exact: e4m3 fits in bf16/fp16)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
        for start in range(BLOCK_K, k, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if SCALED:
            acc *= tl.load(scale_ptr + offs_n, mask=col_ok, other=0.0)[None, :]
        tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _single_row_linear_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        n,
        k,
        stride_w,
        needed_ptr,
        scale_ptr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        PREDICATED: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < n
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        if PREDICATED:  # as above
            if USE_PDL:
                wait_for_prior_grid()
            if tl.load(needed_ptr) == 0:
                tl.store(out_ptr + offs_n, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), col_ok)
                return
        offs_k = tl.arange(0, BLOCK_K)  # first tile before the wait, as above
        w = tl.load(
            w_rows + offs_k[None, :], mask=col_ok[:, None] & (offs_k < k)[None, :], other=0.0
        )
        if USE_PDL and not PREDICATED:
            wait_for_prior_grid()
        x = tl.load(x_ptr + offs_k, mask=offs_k < k, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        for start in range(BLOCK_K, k, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if SCALED:
            acc *= tl.load(scale_ptr + offs_n, mask=col_ok, other=0.0)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: TileConfig,
    needed: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] @ weight[N, K].T with the Triton kernel (no selection); the single-row
    kernel needs M == 1. `needed` (device int32 [1]): where 0, the kernel reads no weight and
    writes zeros. `scale` (fp32 [N]): `weight` is float8_e4m3fn and the product is
    x @ (scale[:, None] * weight).T, the scale applied once per output in the epilogue."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    pdl = grid_dependency.enabled(x)
    grid = (triton.cdiv(n, config.block_n),)
    # out: a placeholder for a flag or scales the kernel does not read
    flag, scales = (out if needed is None else needed), (out if scale is None else scale)
    constants = dict(
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=pdl,
        PREDICATED=needed is not None, SCALED=scale is not None, num_warps=config.num_warps,
        num_stages=config.num_stages, **launch_options(pdl),
    )  # fmt: skip
    if config.single_row:
        if rows != 1:
            raise ValueError(f"the single-row kernel takes 1 row, got {rows}")
        _single_row_linear_kernel[grid](
            x, weight, out, n, k, weight.stride(0), flag, scales, **constants
        )
    else:
        _small_rows_linear_kernel[grid](
            x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), flag,
            scales, BLOCK_M=16, **constants,
        )  # fmt: skip
    return out


def _rows_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


class SmallBatchLinear:
    """Chooses, per (rows bucket, N, K, dtype, device), between cuBLAS and the kernel."""

    def __init__(self) -> None:
        self.choices: dict[tuple, TileConfig | None] = {}

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, *, needed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T; `needed` (device int32 [1]) lets a Triton choice skip the work and
        return zeros where it holds 0 (cuBLAS always computes)."""
        if not self._eligible(x, weight):
            return F.linear(x, weight)
        key = (_rows_bucket(x.shape[0]), *weight.shape, weight.dtype, x.device)
        if key not in self.choices:
            self.choices[key] = self._measure(key[0], weight)
        config = self.choices[key]
        return F.linear(x, weight) if config is None else launch(x, weight, config, needed)

    @staticmethod
    def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            triton is not None
            and x.is_cuda
            and not INTERPRETED
            and x.dim() == 2
            and x.shape[0] <= MAX_ROWS
            and weight.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == weight.dtype
            and weight.stride(1) == 1
        )

    @staticmethod
    def _measure(rows: int, weight: torch.Tensor) -> TileConfig | None:
        """The fastest of cuBLAS (None) and every config that computes the same product, each
        timed over cold weights as in a loop (module doc)."""
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        weights = _cold_copies(weight)
        reference = F.linear(x, weight).float()
        scale = reference.abs().max().item() + 1e-6
        best, best_ms = None, _time_over(weights, lambda w: F.linear(x, w))
        cublas_ms = best_ms
        for config in CONFIGS:
            if config.single_row and rows != 1:
                continue
            out = launch(x, weight, config).float()
            if (out - reference).abs().max().item() > 0.02 * scale:
                continue  # never choose a configuration that computes something else
            ms = _time_over(weights, lambda w, c=config: launch(x, w, c))
            if ms < best_ms and ms < MARGIN * cublas_ms:
                best, best_ms = config, ms
        return best


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` plus random copies of its shape, together over COLD_L2_FACTOR x the L2 cache
    (fewer where device memory is short: the timing is then warmer, never wrong)."""
    properties = torch.cuda.get_device_properties(weight.device)
    l2_bytes = getattr(properties, "L2_cache_size", 0) or 64 << 20
    weight_bytes = weight.numel() * weight.element_size()
    wanted = min(MAX_COPIES, -(-COLD_L2_FACTOR * l2_bytes // weight_bytes)) - 1
    free_bytes, _ = torch.cuda.mem_get_info(weight.device)
    extra = max(0, min(wanted, free_bytes // 4 // weight_bytes))
    return [weight] + [torch.randn_like(weight) * 0.02 for _ in range(extra)]


def _time_over(weights: list[torch.Tensor], fn, replays: int = 20) -> float:
    """Median ms of replaying a CUDA graph that calls fn(w) once per weight."""

    def calls():
        return [fn(w) for w in weights]

    calls()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = calls()
    times = []
    for index in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        if index >= 3:  # the first replays upload the graph and warm the clocks
            times.append((start, end))
    torch.cuda.synchronize()
    del outputs, graph
    return statistics.median(start.elapsed_time(end) for start, end in times)


small_batch_linear = SmallBatchLinear()
