"""Triton tiled kernel of paged attention (prefill and mixed calls), online softmax over the
pages of each group, and the store kernel shared by every Triton path.

One program handles one (group, query tile, kv head); its rows are BLOCK_Q queries times the
G query heads sharing the kv head, so a page's keys and values are loaded once for all of them.
README.md, "Backends and capabilities", gives the tile, the causal limit, the sliding-window key
walk and why every launch size is a host int of the bound call (no read-back). Decode-only calls
use the split-KV kernels of `split_decode_kernel` instead.

Importing this module decorates the kernel: on a machine without CUDA set TRITON_INTERPRET=1
before importing it to run the kernel (slowly) on CPU tensors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from rlt_contracts.dependent_launch import launch_options

from rlt_attention import grid_dependency
from rlt_attention.grid_dependency import wait_for_prior_grid

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's interpreter rounds some fp32 -> e4m3 conversions wrongly (125.46 -> 64, measured with
# triton 3.x on the CPU): there the fp8 cache's writes round on the e4m3 grid first (exact in fp32),
# and the conversion only sees representable values. Compiled kernels use the hardware rounding.
SOFTWARE_E4M3_ROUNDING = tl.constexpr(INTERPRETED)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [N, H, D] query dtype
    query_ptr,  # [N, H, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D] of one layer, cache dtype
    value_cache_ptr,  # same layout as key_cache_ptr
    block_tables_ptr,  # [S, max_pages] int32
    query_start_ptr,  # [S + 1] int32
    context_lengths_ptr,  # [S] int32
    key_scale_ptr,  # fp32 [1] (KV_FP8): the layer's key scale
    value_scale_ptr,  # fp32 [1] (KV_FP8): the layer's value scale
    scale_log2,  # D^-0.5 * log2(e): scores are exponentiated with exp2
    stride_query_row,
    stride_query_head,
    stride_out_row,
    stride_out_head,
    stride_key_block,
    stride_key_offset,
    stride_key_head,
    stride_value_block,
    stride_value_offset,
    stride_value_head,
    stride_table_group,
    num_query_tiles,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (>= 16)
    PAGE_SIZE: tl.constexpr,  # KV block size in positions
    QUERIES_PER_KV: tl.constexpr,  # G = H / Hkv
    BLOCK_Q: tl.constexpr,  # queries per tile (BLOCK_M // G)
    BLOCK_M: tl.constexpr,  # rows per tile (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # key positions per step (>= 16 for tl.dot)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch
    KV_FP8: tl.constexpr,  # the cache is e4m3 with per-layer scales
    CAUSAL: tl.constexpr,  # False: every row of a group sees the group's whole context
    WINDOW: tl.constexpr,  # > 0: sliding window (row at p sees keys p - WINDOW + 1 .. p)
):
    if USE_PDL:
        wait_for_prior_grid()
    group = tl.program_id(0) // num_query_tiles
    query_tile = tl.program_id(0) % num_query_tiles
    kv_head = tl.program_id(1)

    query_begin = tl.load(query_start_ptr + group)
    query_len = tl.load(query_start_ptr + group + 1) - query_begin
    tile_begin = query_tile * BLOCK_Q  # first query (group-local) of this tile
    if tile_begin >= query_len:
        return
    context_len = tl.load(context_lengths_ptr + group)
    first_query_position = context_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    local_query = tile_begin + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (local_query < query_len)
    row = (query_begin + local_query).to(tl.int64)
    query_position = first_query_position + local_query  # causal limit of each row (inclusive)
    offs_d = tl.arange(0, BLOCK_D)
    dim_valid = offs_d < HEAD_DIM

    query_row = row * stride_query_row + head * stride_query_head
    row_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + query_row[:, None] + offs_d[None, :], mask=row_mask, other=0.0)
    if KV_FP8:  # keys and values are widened to the query dtype; the scales fold in once
        scale_log2 = scale_log2 * tl.load(key_scale_ptr)
        if q.dtype == tl.bfloat16:  # e4m3 widens to fp16 in one instruction (not to bf16)
            q = q.to(tl.float16)
    else:
        q = q.to(key_cache_ptr.dtype.element_ty)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if CAUSAL:  # keys past the tile's last query are invisible to every row of the tile
        key_end = first_query_position + tl.minimum(query_len, tile_begin + BLOCK_Q)
    else:  # a bidirectional group: every row sees the whole context
        key_end = context_len
    key_begin_first = 0
    if WINDOW > 0:
        # Keys before the tile's first row's window are invisible to every row of the tile and
        # are never loaded (nor their pages' table entries). The loop starts at the step that
        # holds the first visible key, on the absolute BLOCK_N grid, so a row's steps are the
        # same whatever else shares its tile (batch invariance); the keys of that step before
        # the window are masked like those past key_end.
        key_window_start = tl.maximum(first_query_position + tile_begin - WINDOW + 1, 0)
        key_begin_first = key_window_start // BLOCK_N * BLOCK_N
    for key_begin in range(key_begin_first, key_end, BLOCK_N):
        key_position = key_begin + tl.arange(0, BLOCK_N)
        key_valid = key_position < key_end
        if WINDOW > 0:
            key_valid = key_valid & (key_position >= key_window_start)
        block = tl.load(
            block_tables_ptr + group * stride_table_group + key_position // PAGE_SIZE,
            mask=key_valid,
            other=0,
        ).to(tl.int64)
        offset = key_position % PAGE_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        key_row = block * stride_key_block + offset * stride_key_offset + kv_head * stride_key_head
        k = tl.load(key_cache_ptr + key_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            visible = (key_position[None, :] <= query_position[:, None]) & key_valid[None, :]
            if WINDOW > 0:
                visible = visible & (key_position[None, :] > query_position[:, None] - WINDOW)
        else:
            visible = (query_position[:, None] >= 0) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing seen yet
        correction = tl.exp2(row_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, 1)
        value_row = (
            block * stride_value_block + offset * stride_value_offset + kv_head * stride_value_head
        )
        v = tl.load(value_cache_ptr + value_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        row_max = new_max

    out = acc / row_sum[:, None]
    if KV_FP8:
        out = out * tl.load(value_scale_ptr)
    out_row = row * stride_out_row + head * stride_out_head
    tl.store(
        out_ptr + out_row[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


@dataclass(frozen=True)
class TileConfig:
    """Launch configuration (host ints): rows per tile, queries per tile, keys per step, warps."""

    block_m: int
    block_q: int
    block_n: int
    block_d: int
    num_warps: int


def choose_tiles(
    *,
    max_query_len: int,
    queries_per_kv: int,
    head_dim: int,
    block_m: int | None,
    block_n: int | None,
) -> TileConfig:
    """Decode-only calls use 16-row tiles (filled by the G heads); prefill uses 64 (32 if D > 128).

    The heuristics are untuned defaults; `block_m` / `block_n` override them (powers of two >= 16).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_m is None:
        block_m = 16 if max_query_len <= 1 else (64 if block_d <= 128 else 32)
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    return TileConfig(block_m, block_m // queries_per_kv, block_n, block_d, num_warps)


def unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only where its last dim is strided (the kernels index it densely)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def scale_arguments(placeholder: torch.Tensor, key_scale, value_scale) -> tuple[torch.Tensor, ...]:
    """The kernels' key_scale_ptr and value_scale_ptr: an fp8 cache's layer scales, or (unread
    without KV_FP8) `placeholder`."""
    return (
        placeholder if key_scale is None else key_scale,
        placeholder if value_scale is None else value_scale,
    )


def read_strides(query, out, key_cache, value_cache, block_tables) -> tuple[int, ...]:
    """The read kernels' stride arguments, in their order: query and output (row, head), key and
    value cache (block, offset, head), block table (group)."""
    strides = (*query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3])
    return (*strides, *value_cache.stride()[:3], block_tables.stride(0))


def launch_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lengths: torch.Tensor,
    *,
    max_query_len: int,
    tiles: TileConfig,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
) -> None:
    """Write attention of `query` [N, H, D] over one layer's paged cache into `out` [N, H, D].
    `causal` False: every query of a group sees the group's whole context (a prefix-LM prompt).
    `window` W: the query at position p sees keys p - W + 1 .. p only (causal groups; each W
    compiles its own kernel, None the unwindowed one).

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] (one layer), last dim contiguous.
    key_scale / value_scale: fp32 [1] device tensors, the layer's scales of an fp8 cache.
    block_tables [S, P] int32, query_start [S + 1] int32, context_lengths [S] int32, same device.
    Launch grid: (S * ceil(max_query_len / BLOCK_Q), Hkv); no host sync.
    """
    if window is not None and not causal:
        raise ValueError("a sliding window applies to causal groups only")
    num_groups = context_lengths.shape[0]
    _, num_heads, head_dim = query.shape
    _, page_size, kv_heads, _ = key_cache.shape
    num_query_tiles = triton.cdiv(max_query_len, tiles.block_q)
    if num_groups == 0 or num_query_tiles == 0:
        return
    grid = (num_groups * num_query_tiles, kv_heads)
    pdl = grid_dependency.enabled(query)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start,
        context_lengths,
        *scale_arguments(query, key_scale, value_scale),
        head_dim**-0.5 * math.log2(math.e),
        *read_strides(query, out, key_cache, value_cache, block_tables),
        num_query_tiles,
        HEAD_DIM=head_dim,
        BLOCK_D=tiles.block_d,
        PAGE_SIZE=page_size,
        QUERIES_PER_KV=num_heads // kv_heads,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        USE_PDL=pdl,
        KV_FP8=key_scale is not None,
        CAUSAL=causal,
        WINDOW=window or 0,
        num_warps=tiles.num_warps,
        **launch_options(pdl),
    )


@triton.jit
def quantize_fp8(x, scale):
    """x / scale saturated to e4m3's +-448, rounded to nearest even e4m3 (as
    `kv_store.quantize`)."""
    x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    if SOFTWARE_E4M3_ROUNDING:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the e4m3 grid in fp32 arithmetic: 3 mantissa bits, so
    the spacing is 2**(exponent - 3), and 2**-9 for subnormals (exponent floor -6)."""
    magnitude = tl.abs(x)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = ((tl.maximum(exponent, -6) + 124) << 23).to(tl.float32, bitcast=True)
    steps = magnitude / spacing  # exact: a power-of-two division
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2**23: round half to even
    return tl.where(x < 0, -steps * spacing, steps * spacing)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [N, Hkv, D]
    value_ptr,  # [N, Hkv, D]
    key_slots_ptr,  # [num_slots, Hkv, D] of one layer, cache dtype
    value_slots_ptr,  # same layout
    write_slots_ptr,  # [N] int64
    key_scale_ptr,  # fp32 [1] (KV_FP8): stored = x / scale, saturated to +-448
    value_scale_ptr,
    stride_key_row,
    stride_key_head,
    stride_value_row,
    stride_value_head,
    stride_key_slot,
    stride_key_slot_head,
    stride_value_slot,
    stride_value_slot_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch
    KV_FP8: tl.constexpr,
):
    if USE_PDL:
        wait_for_prior_grid()
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(write_slots_ptr + row)
    key = tl.load(
        key_ptr + row * stride_key_row + heads[:, None] * stride_key_head + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + row * stride_value_row + heads[:, None] * stride_value_head + offs_d[None, :],
        mask=mask,
    )
    if KV_FP8:
        key = quantize_fp8(key, tl.load(key_scale_ptr))
        value = quantize_fp8(value, tl.load(value_scale_ptr))
    tl.store(
        key_slots_ptr
        + slot * stride_key_slot
        + heads[:, None] * stride_key_slot_head
        + offs_d[None, :],
        key.to(key_slots_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_slots_ptr
        + slot * stride_value_slot
        + heads[:, None] * stride_value_slot_head
        + offs_d[None, :],
        value.to(value_slots_ptr.dtype.element_ty),
        mask=mask,
    )


def launch_store_kv(
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    write_slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """One launch writing key/value [N, Hkv, D] at write_slots [N] int64 of one layer's slot
    views [num_slots, Hkv, D], cast to the cache dtype: the writes of `kv_store.store_kv` (two
    index_copy_) in one kernel. Slots must be distinct (else the winner is unspecified).
    key_scale / value_scale (fp32 [1]): an fp8 cache's layer scales, as `kv_store.quantize`."""
    num_rows, kv_heads, head_dim = key.shape
    if num_rows == 0:
        return
    key, value = unit_last_stride(key), unit_last_stride(value)
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(kv_heads), max(1, 4096 // block_d))
    pdl = grid_dependency.enabled(key)
    _store_kv_kernel[(num_rows, triton.cdiv(kv_heads, block_h))](
        key,
        value,
        key_slots,
        value_slots,
        write_slots,
        *scale_arguments(key, key_scale, value_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_slots.stride(0),
        key_slots.stride(1),
        value_slots.stride(0),
        value_slots.stride(1),
        kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        USE_PDL=pdl,
        KV_FP8=key_scale is not None,
        num_warps=4,
        **launch_options(pdl),
    )
