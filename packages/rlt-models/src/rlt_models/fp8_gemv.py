"""A persistent one-row GEMV over an fp8 weight: y = (x @ data.T) * scale, x bf16/fp16 [1, K].

Why another kernel: the one-row kernel of `small_batch_linear` gives each CTA 2-8 output rows
and one pass over K. On an fp8 weight at K = 2048 a CTA then loads 4 KB of weight and the same
4 KB of x, changes x's register layout through shared memory, sums across warps, loads the
channel scales only after the weight (a second memory round trip) and exits: per weight byte
twice the fixed work of the bf16 kernel. Its sm_90 code has no asynchronous copies (its loads
are not software-pipelined) and ~4.4 instructions per weight element (x widened per CTA, the
cross-warp sums); at the H200's ~18 fp8 bytes per SM clock that is two thirds of the issue
rate. This kernel (`launch_persistent`):

- is persistent: one balanced wave of resident programs (from the compiled kernel's registers
  and shared memory), each walking output tiles pid, pid + grid, ...; a tile is `block_n` rows
  by the whole K, read in 1-3 chunks of `block_k` (K <= 3 * block_k);
- keeps x resident: each program reads x once, after its first weight tiles, as fp32 registers
  in the tile's layout (no per-tile layout change);
- double- (`num_stages` 2) or triple-buffers whole tiles in registers: the loop is unrolled by
  the stage count so each load goes to the registers the tile just multiplied has freed (no
  copies, no dependence on Triton's pipeliner), and a tile's scales come with its weight;
- reads the weight as int32 words of 4 e4m3 with `.cg` loads (L2 only) and widens each word
  with two `cvt.rn.f16x2.e4m3x2` (inline PTX, sm_89+): 2.5 instructions per element (the two
  conversions, f16 to f32, one FFMA) plus the address arithmetic and one sum per tile row.

Programmatic dependent launch as in `small_batch_linear`: the first weight tiles and scales
load before `wait_for_prior_grid()`, x after. With `needed` (int32 [1], written by the previous
kernel) a program waits first and, where the flag is 0, writes zeros and reads no weight. No
host sync and no allocation beyond the output: CUDA-graph safe. The grid is set at the first
call for a (config, dtype, chunks, device), which compiles the kernel: keep that call outside
graph capture, as `Fp8Linear` does. Configs carry `TileConfig`'s field names, so
`kernel_choice_cache` stores and restores them as tiles (`Fp8Linear` maps them back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from rlt_contracts.dependent_launch import launch_options

from rlt_models import grid_dependency
from rlt_models import small_batch_linear as sbl

triton, tl = sbl.triton, (sbl.tl if sbl.triton is not None else None)
MAX_CHUNKS = 3


@dataclass(frozen=True)
class GemvConfig:
    """block_n output rows per tile, K read in chunks of block_k (K <= 3 * block_k), num_stages
    tiles buffered per program (2 or 3); single_row: always (`TileConfig`'s field names)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2
    single_row: bool = True


# Compiled for sm_90 (Triton 3.6 and 3.9): 3.3-3.8 instructions per weight element in the loop
# at K = 2048 for the first five (1-2 chunks, 128-220 registers), 3.3-3.7 at K = 5632 (down: 3
# chunks of 2048, 8% of the lanes masked) for the last five without spills. The selection
# measures every config on every shape anyway (the 1-warp 2K one spills at K = 5632).
CONFIGS = (
    GemvConfig(2, 1024, 1, 2),
    GemvConfig(2, 1024, 1, 3),
    GemvConfig(2, 2048, 1, 2),
    GemvConfig(4, 1024, 2, 2),
    GemvConfig(8, 1024, 4, 2),
    GemvConfig(2, 2048, 2, 2),
    GemvConfig(2, 2048, 4, 2),
    GemvConfig(4, 2048, 4, 2),
    GemvConfig(4, 2048, 8, 2),
    GemvConfig(8, 2048, 4, 2),
)

if triton is not None:
    from rlt_models.grid_dependency import wait_for_prior_grid

    @triton.jit
    def _widen(words, ASM: tl.constexpr):
        """The 4 e4m3 of each int32 word (bytes 0-3: columns 4c to 4c + 3) as 4 fp32 tensors,
        exactly. ASM: two cvt.rn.f16x2.e4m3x2 on the word's halves; the portable form (the
        interpreter) shifts each byte out, and LLVM repacks the pairs: more instructions."""
        if ASM:
            return tl.inline_asm_elementwise(
                """{
                .reg .b16 lo, hi, a0, a1, b0, b1;
                .reg .b32 a, b;
                mov.b32 {lo, hi}, $4;
                cvt.rn.f16x2.e4m3x2 a, lo;
                cvt.rn.f16x2.e4m3x2 b, hi;
                mov.b32 {a0, a1}, a;
                mov.b32 {b0, b1}, b;
                cvt.f32.f16 $0, a0;
                cvt.f32.f16 $1, a1;
                cvt.f32.f16 $2, b0;
                cvt.f32.f16 $3, b1;
                }""",
                "=r,=r,=r,=r,r",
                [words],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True,
                pack=1,
            )
        else:
            return _byte(words, 0), _byte(words, 1), _byte(words, 2), _byte(words, 3)

    @triton.jit
    def _byte(words, j: tl.constexpr):
        byte = ((words >> (8 * j)) & 0xFF).to(tl.uint8)
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _x_chunk(x_ptr, k, chunk: tl.constexpr, BLOCK_W: tl.constexpr):
        """x[4c + j] for the word columns c of chunk `chunk`, j = 0..3 (4 fp32 tensors)."""
        offs = (chunk * BLOCK_W + tl.arange(0, BLOCK_W)) * 4
        x0 = tl.load(x_ptr + offs, mask=offs < k, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + offs + 1, mask=offs + 1 < k, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + 2, mask=offs + 2 < k, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + offs + 3, mask=offs + 3 < k, other=0.0).to(tl.float32)
        return x0, x1, x2, x3

    @triton.jit
    def _load_tile(w_ptr, scale_ptr, t, at,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
        """This program's tile t (`at`: first tile, programs, this program's tiles, n, K / 4,
        row stride): its rows as CHUNKS int32 word tensors [BLOCK_N, BLOCK_W] (0 for absent
        chunks) and their scales, all masked past the program's last tile."""
        first, programs, my_tiles, n, kw, stride_w = at
        offs_n = (first + t * programs) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_W)
        row_ok = offs_n < tl.where(t < my_tiles, n, 0)  # (the interpreter mistypes bool & bool)
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + cols[None, :]
        chunk = tl.load(
            rows, mask=row_ok[:, None] & (cols < kw)[None, :], other=0, cache_modifier=".cg"
        )
        words = (chunk, 0, 0)
        for c in tl.static_range(1, CHUNKS):
            ok = row_ok[:, None] & (cols + c * BLOCK_W < kw)[None, :]
            chunk = tl.load(rows + c * BLOCK_W, mask=ok, other=0, cache_modifier=".cg")
            words = (words[0], chunk, words[2]) if c == 1 else (words[0], words[1], chunk)
        return words, tl.load(scale_ptr + offs_n, mask=row_ok, other=0.0)

    @triton.jit
    def _products(acc, words, x, ASM: tl.constexpr, FIRST: tl.constexpr):
        """(acc +) each word's 4 products with x ([BLOCK_N, BLOCK_W] fp32, FFMA chains)."""
        w0, w1, w2, w3 = _widen(words, ASM)
        x0, x1, x2, x3 = x
        if FIRST:
            acc = w0 * x0[None, :]
        else:
            acc += w0 * x0[None, :]
        acc += w1 * x1[None, :]
        acc += w2 * x2[None, :]
        return acc + w3 * x3[None, :]

    @triton.jit
    def _finish(tile, x, t, at, out_ptr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                ASM: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
        """Store tile t's outputs: its rows' products with x, summed, times the scales (CHECK:
        only where t is one of this program's tiles)."""
        first, programs, my_tiles, n, _, _ = at
        if not CHECK or t < my_tiles:
            words, scale = tile
            acc = _products(0.0, words[0], x[0], ASM, True)
            for c in tl.static_range(1, CHUNKS):
                acc = _products(acc, words[c], x[c], ASM, False)
            offs_n = (first + t * programs) * BLOCK_N + tl.arange(0, BLOCK_N)
            y = tl.sum(acc, axis=1) * scale
            tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < n)

    @triton.jit
    def _persistent_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, needed_ptr, n, k, stride_w,
                                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                                CHUNKS: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
                                USE_PDL: tl.constexpr, PREDICATED: tl.constexpr):  # fmt: skip
        """w_ptr: the weight as int32 words [N, K / 4], K <= CHUNKS * 4 * BLOCK_W."""
        first = tl.program_id(0)
        programs = tl.num_programs(0)
        my_tiles = tl.cdiv(tl.cdiv(n, BLOCK_N) - first, programs)
        at = (first, programs, my_tiles, n, k // 4, stride_w)
        if PREDICATED:  # the flag comes from the previous kernel: wait first
            if USE_PDL:
                wait_for_prior_grid()
            if tl.load(needed_ptr) == 0:
                for t in range(my_tiles):
                    offs_n = (first + t * programs) * BLOCK_N + tl.arange(0, BLOCK_N)
                    zeros = tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty)
                    tl.store(out_ptr + offs_n, zeros, mask=offs_n < n)
                return
        # the first tiles before waiting for the previous kernel (weights never change), x after
        a = _load_tile(w_ptr, scale_ptr, 0, at, BLOCK_N, BLOCK_W, CHUNKS)
        if STAGES >= 3:
            b = _load_tile(w_ptr, scale_ptr, 1, at, BLOCK_N, BLOCK_W, CHUNKS)
        if USE_PDL and not PREDICATED:
            wait_for_prior_grid()
        x = (_x_chunk(x_ptr, k, 0, BLOCK_W), 0, 0)
        if CHUNKS >= 2:
            x = (x[0], _x_chunk(x_ptr, k, 1, BLOCK_W), 0)
        if CHUNKS >= 3:
            x = (x[0], x[1], _x_chunk(x_ptr, k, 2, BLOCK_W))
        # Tile 0 (every program has one) outside the loop, unconditionally: x's change to the
        # tile's layout happens there once (the loop's identical conversions fold into it).
        # The loop is unrolled by STAGES: each load fills the registers of the tile just used.
        if STAGES >= 3:
            c = _load_tile(w_ptr, scale_ptr, 2, at, BLOCK_N, BLOCK_W, CHUNKS)
            _finish(a, x, 0, at, out_ptr, BLOCK_N, CHUNKS, ASM, False)
            a = _load_tile(w_ptr, scale_ptr, 3, at, BLOCK_N, BLOCK_W, CHUNKS)
            for t in range(1, my_tiles, 3):
                _finish(b, x, t, at, out_ptr, BLOCK_N, CHUNKS, ASM, True)
                b = _load_tile(w_ptr, scale_ptr, t + 3, at, BLOCK_N, BLOCK_W, CHUNKS)
                _finish(c, x, t + 1, at, out_ptr, BLOCK_N, CHUNKS, ASM, True)
                c = _load_tile(w_ptr, scale_ptr, t + 4, at, BLOCK_N, BLOCK_W, CHUNKS)
                _finish(a, x, t + 2, at, out_ptr, BLOCK_N, CHUNKS, ASM, True)
                a = _load_tile(w_ptr, scale_ptr, t + 5, at, BLOCK_N, BLOCK_W, CHUNKS)
        else:
            b = _load_tile(w_ptr, scale_ptr, 1, at, BLOCK_N, BLOCK_W, CHUNKS)
            _finish(a, x, 0, at, out_ptr, BLOCK_N, CHUNKS, ASM, False)
            a = _load_tile(w_ptr, scale_ptr, 2, at, BLOCK_N, BLOCK_W, CHUNKS)
            for t in range(1, my_tiles, 2):
                _finish(b, x, t, at, out_ptr, BLOCK_N, CHUNKS, ASM, True)
                b = _load_tile(w_ptr, scale_ptr, t + 2, at, BLOCK_N, BLOCK_W, CHUNKS)
                _finish(a, x, t + 1, at, out_ptr, BLOCK_N, CHUNKS, ASM, True)
                a = _load_tile(w_ptr, scale_ptr, t + 3, at, BLOCK_N, BLOCK_W, CHUNKS)


def eligible(data: torch.Tensor, config: GemvConfig) -> bool:
    """The weight reads as int32 words of 4 e4m3 (rows contiguous, K and the row stride
    multiples of 4, 4-byte aligned) and K fits in MAX_CHUNKS chunks of block_k."""
    k = data.shape[1]
    return (
        data.stride(1) == 1
        and k % 4 == 0
        and data.stride(0) % 4 == 0
        and data.data_ptr() % 4 == 0
        and 0 < k <= MAX_CHUNKS * config.block_k
    )


# (config, x dtype, chunks, device) -> resident programs per SM, from the first compiled launch
_per_sm: dict[tuple, int] = {}


def _programs_per_sm(compiled, num_warps: int, device: torch.device) -> int | None:
    """How many programs of `compiled` one SM holds at once (threads, registers, shared memory,
    32 CTAs), or None where the compiled kernel does not say (the interpreter)."""
    regs = getattr(compiled, "n_regs", None)
    if not regs:
        return None
    props = torch.cuda.get_device_properties(device)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
    limits = (
        32,
        getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps),
        getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * num_warps),
        getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024),
    )
    return max(1, min(limits))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grid(tiles: int, per_sm: int, device: torch.device) -> int:
    """One wave of `per_sm` programs per SM, balanced: ceil(tiles / wave) tiles each."""
    wave = per_sm * _sm_count(device)
    per_program = -(-tiles // wave)
    return -(-tiles // per_program)


def launch_persistent(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    config: GemvConfig,
    needed: torch.Tensor | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """x [1, K] (bf16/fp16) @ (scale[:, None] * data).T with data e4m3 [N, K], scale fp32 [N];
    `needed` (device int32 [1]): where 0, zeros and no weight read. `programs` fixes the grid
    (tests); by default one balanced wave of resident programs (module doc)."""
    rows, k = x.shape
    if rows != 1 or not eligible(data, config):
        raise ValueError(f"the persistent GEMV does not take x {tuple(x.shape)}, {config}")
    n = data.shape[0]
    words = data.view(torch.int32)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    tiles = triton.cdiv(n, config.block_n)
    chunks = triton.cdiv(k, config.block_k)
    key = (config, x.dtype, chunks, x.device)
    if programs is None:  # the first call: a provisional wave, then the compiled kernel's
        per_sm = _per_sm.get(key, max(1, 16 // config.num_warps))
        programs = _grid(tiles, per_sm, x.device) if x.is_cuda else tiles
    pdl = grid_dependency.enabled(x)
    compiled = _persistent_gemv_kernel[(max(1, min(programs, tiles)),)](
        x,
        words,
        scale,
        out,
        out if needed is None else needed,
        n,
        k,
        words.stride(0),
        BLOCK_N=config.block_n,
        BLOCK_W=config.block_k // 4,
        CHUNKS=chunks,
        STAGES=config.num_stages,
        ASM=not sbl.INTERPRETED,
        USE_PDL=pdl,
        PREDICATED=needed is not None,
        num_warps=config.num_warps,
        num_stages=1,
        **launch_options(pdl),
    )
    if key not in _per_sm and x.is_cuda:
        per_sm = _programs_per_sm(compiled, config.num_warps, x.device)
        if per_sm is not None:
            _per_sm[key] = per_sm
    return out
