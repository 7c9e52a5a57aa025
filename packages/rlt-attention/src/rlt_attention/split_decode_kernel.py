"""Triton split-KV ("flash-decoding") paged attention for decode-only calls.

When every group of a call has one query (decode rows), or a few (up to `max_split_queries`:
the positions a speculative round verifies), the split kernel runs a (group, kv head, split)
grid in which split s covers keys [s * L, min((s + 1) * L, context_len)), L =
ceil(ceil(context_len / num_splits) / BLOCK_N) * BLOCK_N computed on the device, and writes an
fp32 partial per query row and head (running max, sum of exponentials, unnormalised
accumulator); the combine kernel merges the splits of every (query row, head) into the output.
The rows of the `tl.dot` tile are the group's (query, head) pairs: its q queries times the G
query heads of the kv head, so each key is loaded once for all of them, and query i (at
position context_len - q + i) is masked causally. With one split the split kernel
normalises and writes the output itself. num_splits is a function of bind-time host ints only,
so a CUDA graph captured with full-width block tables keeps a fixed grid.

Optionally (`fused_decode` of the backend) the split kernel also stores the call's own keys and
values and its last split to finish merges the partials (atomic ticket), saving two launches;
measured slower on an H200, so the backend does not use it by default.

Importing this module decorates the kernels: on a machine without CUDA set TRITON_INTERPRET=1
before importing it to run them (slowly) on CPU tensors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rlt_attention import dependent_launch
from rlt_attention.dependent_launch import wait_for_prior_grid
from rlt_attention.triton_kernel import quantize_fp8


@triton.jit
def _split_decode_kernel(
    out_ptr,  # [N, H, D] query dtype (written only when DIRECT_OUTPUT)
    partial_max_ptr,  # [S, H, num_splits] fp32, log2 units (unused when DIRECT_OUTPUT)
    partial_sum_ptr,  # [S, H, num_splits] fp32
    partial_acc_ptr,  # [S, H, num_splits, HEAD_DIM] fp32, unnormalised
    query_ptr,  # [N, H, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D] of one layer, cache dtype
    value_cache_ptr,  # same layout as key_cache_ptr
    block_tables_ptr,  # [S, max_pages] int32
    query_start_ptr,  # [S + 1] int32
    context_lengths_ptr,  # [S] int32
    new_key_ptr,  # [N, Hkv, D]: the call's keys (STORE_NEW)
    new_value_ptr,  # [N, Hkv, D]
    write_slots_ptr,  # [N] int64: where they are stored
    tickets_ptr,  # [S, Hkv] int32, all 0 between calls (FUSED_COMBINE)
    key_scale_ptr,  # fp32 [1] (KV_FP8): the layer's key scale
    value_scale_ptr,  # fp32 [1] (KV_FP8): the layer's value scale
    scale_log2,  # D^-0.5 * log2(e)
    num_splits,  # host int: splits per (group, kv head) = grid axis 2
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
    stride_new_key_row,
    stride_new_key_head,
    stride_new_value_row,
    stride_new_value_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (>= 16)
    PAGE_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,  # G = H / Hkv
    QUERIES_PER_GROUP: tl.constexpr,  # most query rows of one group (1 for decode rows)
    BLOCK_M: tl.constexpr,  # rows of the tl.dot tile: the q x G (query, head) pairs, >= 16
    BLOCK_N: tl.constexpr,  # key positions per step
    DIRECT_OUTPUT: tl.constexpr,  # num_splits == 1: normalise and write the output here
    STORE_NEW: tl.constexpr,  # the query's own key/value come from new_*_ptr and are stored
    FUSED_COMBINE: tl.constexpr,  # the last split to finish merges all splits (no 2nd kernel)
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits (FUSED_COMBINE)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch
    KV_FP8: tl.constexpr,  # the cache is e4m3 with per-layer scales
    KEYS_AS_ROWS: tl.constexpr,  # products as keys x rows: widened K/V stay the register operand
):
    if USE_PDL:
        wait_for_prior_grid()
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    query_begin = tl.load(query_start_ptr + group)
    query_len = tl.load(query_start_ptr + group + 1) - query_begin
    if query_len == 0:
        return  # padding group without a query row
    # The group's queries are its last query_len positions; each sees every key up to its own.
    context_len = tl.load(context_lengths_ptr + group)
    per_split = (context_len + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    key_start = split * split_len
    key_end = tl.minimum(key_start + split_len, context_len)

    offs_d = tl.arange(0, BLOCK_D)
    dim_valid = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + group * stride_table_group
    cache_dtype = key_cache_ptr.dtype.element_ty

    # The (query, head) pairs of the group and kv head are the rows of a tile sharing each
    # loaded key: tile row m is query m // G of the group, head kv_head * G + m % G.
    offs_m = tl.arange(0, BLOCK_M)
    query_index = offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < QUERIES_PER_GROUP * QUERIES_PER_KV) & (query_index < query_len)
    row_mask = row_valid[:, None] & dim_valid[None, :]
    row = (query_begin + query_index).to(tl.int64)  # [BLOCK_M] query row of each tile row
    q = tl.load(
        query_ptr
        + row[:, None] * stride_query_row
        + head[:, None] * stride_query_head
        + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if KV_FP8:  # keys and values are widened to the query dtype; the scales fold in once
        scale_log2 = scale_log2 * tl.load(key_scale_ptr)
        if q.dtype == tl.bfloat16:  # e4m3 widens to fp16 in one instruction (not to bf16)
            q = q.to(tl.float16)
    else:
        q = q.to(cache_dtype)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    if KEYS_AS_ROWS:
        q_t = tl.trans(q)  # [BLOCK_D, BLOCK_M]: the small operand, staged once
        acc_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_position = context_len - query_len + query_index  # [BLOCK_M] causal limit per row
    own_position = context_len - 1  # STORE_NEW (one query per group): its own key's position
    if STORE_NEW:
        # The query's own key/value (position context_len - 1) are read from the call's
        # tensors, never from the cache, and the split that covers them stores them: the only
        # program that could read that slot is this one.
        new_key = tl.load(
            new_key_ptr + query_begin * stride_new_key_row + kv_head * stride_new_key_head + offs_d,
            mask=dim_valid,
            other=0.0,
        )
        new_value = tl.load(
            new_value_ptr
            + query_begin * stride_new_value_row
            + kv_head * stride_new_value_head
            + offs_d,
            mask=dim_valid,
            other=0.0,
        )
        if KV_FP8:  # read back below as stored, so that every read of the slot agrees
            new_key = quantize_fp8(new_key, tl.load(key_scale_ptr))
            new_value = quantize_fp8(new_value, tl.load(value_scale_ptr))
        else:
            new_key = new_key.to(cache_dtype)
            new_value = new_value.to(cache_dtype)
        if (key_start <= own_position) & (own_position < key_end):
            slot = tl.load(write_slots_ptr + query_begin)
            slot_block = slot // PAGE_SIZE
            slot_offset = slot % PAGE_SIZE
            tl.store(
                key_cache_ptr
                + slot_block * stride_key_block
                + slot_offset * stride_key_offset
                + kv_head * stride_key_head
                + offs_d,
                new_key,
                mask=dim_valid,
            )
            tl.store(
                value_cache_ptr
                + slot_block * stride_value_block
                + slot_offset * stride_value_offset
                + kv_head * stride_value_head
                + offs_d,
                new_value,
                mask=dim_valid,
            )
    for key_begin in range(key_start, key_end, BLOCK_N):
        key_position = key_begin + offs_n
        key_valid = key_position < key_end
        block = tl.load(table_row + key_position // PAGE_SIZE, mask=key_valid, other=0)
        block = block.to(tl.int64)
        offset = key_position % PAGE_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        if STORE_NEW:
            kv_mask = kv_mask & (key_position != own_position)[:, None]
        key_row = block * stride_key_block + offset * stride_key_offset + kv_head * stride_key_head
        k = tl.load(key_cache_ptr + key_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if STORE_NEW:
            k = tl.where((key_position == own_position)[:, None], new_key[None, :], k)
        k = k.to(q.dtype)
        value_row = (
            block * stride_value_block + offset * stride_value_offset + kv_head * stride_value_head
        )
        if KEYS_AS_ROWS:
            # scores^T = K q^T and acc^T += V^T p^T: the widened keys and values are the
            # products' register operand, never staged through shared memory
            scores_t = tl.dot(k, q_t, input_precision="ieee") * scale_log2  # [BLOCK_N, BLOCK_M]
            visible_t = key_valid[:, None] & (key_position[:, None] <= row_position[None, :])
            scores_t = tl.where(visible_t, scores_t, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores_t, 0))
            finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp2(row_max - finite_max)
            probs_t = tl.exp2(scores_t - finite_max[None, :])
            row_sum = row_sum * correction + tl.sum(probs_t, 0)
            kv_mask_t = dim_valid[:, None] & key_valid[None, :]
            if STORE_NEW:
                kv_mask_t = kv_mask_t & (key_position != own_position)[None, :]
            v_t = tl.load(
                value_cache_ptr + value_row[None, :] + offs_d[:, None], mask=kv_mask_t, other=0.0
            )
            if STORE_NEW:
                v_t = tl.where((key_position == own_position)[None, :], new_value[:, None], v_t)
            v_t = v_t.to(q.dtype)
            acc_t = acc_t * correction[None, :] + tl.dot(
                v_t, probs_t.to(v_t.dtype), input_precision="ieee"
            )
        else:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            visible = key_valid[None, :] & (key_position[None, :] <= row_position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # a row that has seen no key yet (all masked so far) keeps max -inf: exponentials
            # against 0 there give exact zeros instead of NaN
            finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp2(row_max - finite_max)
            probs = tl.exp2(scores - finite_max[:, None])
            row_sum = row_sum * correction + tl.sum(probs, 1)
            v = tl.load(
                value_cache_ptr + value_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
            )
            if STORE_NEW:
                v = tl.where((key_position == own_position)[:, None], new_value[None, :], v)
            v = v.to(q.dtype)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        row_max = new_max
    if KEYS_AS_ROWS:
        acc = tl.trans(acc_t)
    if KV_FP8:  # partials merge linearly: each split's accumulator carries the value scale
        acc = acc * tl.load(value_scale_ptr)
    if DIRECT_OUTPUT:
        tl.store(
            out_ptr
            + row[:, None] * stride_out_row
            + head[:, None] * stride_out_head
            + offs_d[None, :],
            (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        partial = (row * (QUERIES_PER_KV * tl.num_programs(1)) + head) * num_splits + split
        tl.store(partial_max_ptr + partial, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, row_sum, mask=row_valid)
        tl.store(
            partial_acc_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask
        )
        if FUSED_COMBINE:
            # Release our partials, count ourselves in; the last split to arrive (acquire)
            # merges all of them and resets the ticket for the next call.
            ticket_ptr = tickets_ptr + group * tl.num_programs(1) + kv_head
            if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == num_splits - 1:
                offs_s = tl.arange(0, BLOCK_S)
                split_valid = offs_s < num_splits
                for g in tl.static_range(QUERIES_PER_KV):
                    one_head = kv_head * QUERIES_PER_KV + g
                    first = (
                        query_begin * (QUERIES_PER_KV * tl.num_programs(1)) + one_head
                    ) * num_splits
                    split_max = tl.load(
                        partial_max_ptr + first + offs_s,
                        mask=split_valid,
                        other=float("-inf"),
                        cache_modifier=".cg",
                    )
                    split_sum = tl.load(
                        partial_sum_ptr + first + offs_s,
                        mask=split_valid,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    split_acc = tl.load(
                        partial_acc_ptr + (first + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=split_valid[:, None] & dim_valid[None, :],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    total_max = tl.max(split_max, 0)
                    total_max = tl.where(total_max == float("-inf"), 0.0, total_max)
                    weight = tl.exp2(split_max - total_max)
                    merged = tl.sum(split_acc * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
                    tl.store(
                        out_ptr
                        + query_begin * stride_out_row
                        + one_head * stride_out_head
                        + offs_d,
                        merged.to(out_ptr.dtype.element_ty),
                        mask=dim_valid,
                    )
                tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _split_combine_kernel(
    out_ptr,  # [N, H, D] query dtype
    partial_max_ptr,  # [N, H, num_splits] fp32, per query row
    partial_sum_ptr,  # [N, H, num_splits] fp32
    partial_acc_ptr,  # [N, H, num_splits, HEAD_DIM] fp32
    query_start_ptr,  # [S + 1] int32
    num_splits,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    if USE_PDL:
        wait_for_prior_grid()
    group = tl.program_id(0)
    head = tl.program_id(1)
    query = tl.program_id(2)  # the group's query (grid axis 2: its most queries)
    query_begin = tl.load(query_start_ptr + group)
    if tl.load(query_start_ptr + group + 1) - query_begin <= query:
        return
    row = (query_begin + query).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    split_valid = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    dim_valid = offs_d < HEAD_DIM
    partial = (row * tl.num_programs(1) + head) * num_splits + offs_s
    split_max = tl.load(partial_max_ptr + partial, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + partial, mask=split_valid, other=0.0)
    split_acc = tl.load(
        partial_acc_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    total_max = tl.max(split_max, 0)
    total_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp2(split_max - total_max)  # 0 for empty splits (max -inf)
    total_sum = tl.sum(split_sum * weight, 0)
    out = tl.sum(split_acc * weight[:, None], 0) / total_sum
    tl.store(
        out_ptr + row * stride_out_row + head * stride_out_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


# Split-KV decode: enough programs to fill about this many SMs twice (H100 / H200 have 132).
DEFAULT_SM_COUNT = 132
MAX_SPLITS = 64
# programs (groups x kv heads) up to which decode uses many short splits (`choose_splits`)
SMALL_GRID = 64
# An fp8 cache's large-grid key step (block_n, num_warps, num_stages, keys_as_rows): its keys
# and values are widened in registers, so the kernel is bound by that per-element work rather
# than by memory; with keys as the products' rows the widened tiles feed the tensor cores from
# registers. Best of 28 on an H200 at 128 rows x 1,100 keys (24 layers): 5.92 ms per loop
# against 6.28 for the best rows-by-keys step (128, 4, 4) and 6.45 for bf16
# (benchmarks/fp8_kv_attention_sweep.py, benchmarks/results/fp8_h200/keys_as_rows_1a31911/).
# Environment overrides, read at import (sweeps): RLT_FP8_SPLIT_DECODE / RLT_SPLIT_DECODE =
# "block_n,num_warps,num_stages[,keys_as_rows 0|1]" for the fp8 / model-dtype cache's large grid
# (keys as rows did not pay for bf16: 7.45 ms at best).
FP8_SPLIT_ENV = "RLT_FP8_SPLIT_DECODE"
SPLIT_ENV = "RLT_SPLIT_DECODE"
FP8_LARGE_GRID_STEP = (64, 4, 2, True)


def _large_grid_step(variable: str, default: tuple[int, int, int, bool] | None):
    given = os.environ.get(variable)
    if not given:
        return default
    fields = [int(v) for v in given.split(",")]
    if len(fields) not in (3, 4):
        raise ValueError(f"{variable}={given!r}: expected block_n,num_warps,num_stages[,0|1]")
    block_n, num_warps, num_stages = fields[:3]
    return block_n, num_warps, num_stages, bool(fields[3]) if len(fields) == 4 else False


_fp8_step = _large_grid_step(FP8_SPLIT_ENV, FP8_LARGE_GRID_STEP)
_model_dtype_step = _large_grid_step(SPLIT_ENV, None)  # None: the heuristic below


@dataclass(frozen=True)
class SplitConfig:
    """Launch configuration of the split-KV decode kernels (host ints)."""

    num_splits: int
    block_m: int  # rows of the tl.dot tile: the q x G (query, head) pairs padded to >= 16
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int = 3  # software-pipelining depth of the key loop (Triton's default)
    # products as keys x rows (K q^T, V^T p^T) instead of rows x keys: the widened keys and
    # values of an fp8 cache are then the register operand of the tensor-core product
    keys_as_rows: bool = False


def choose_splits(
    *,
    num_groups: int,
    num_kv_heads: int,
    max_context_len: int,
    queries_per_kv: int,
    head_dim: int,
    sm_count: int = DEFAULT_SM_COUNT,
    num_splits: int | None = None,
    block_n: int | None = None,
    queries_per_group: int = 1,
    kv_fp8: bool = False,
) -> SplitConfig:
    """Splits per (group, kv head) and the key step, from bind-time host ints only (a graph
    captured with full-width tables keeps a fixed grid). `num_splits` / `block_n` override the
    heuristic (tests; `block_n` a power of two >= 16).

    Heuristic (head_dim <= 128, from H200 sweeps over all 24 layers' KV of Ouro-1.4B at a ~1.1K
    context, `benchmarks/small_batch_sweep.py`):
    - up to SMALL_GRID unsplit programs (groups x kv heads: 1-4 decode rows of 16 kv heads):
      about 6 programs per SM in short splits (16 keys per step and 2 warps up to 32
      programs, else 32 keys and 4 warps), 2 pipeline stages; the nearest swept configurations were
      2-9% faster per layer call than the rule below at 1-4 rows;
    - otherwise ceil(2 * sm_count / programs) splits of 64-key steps and 4 warps.
    Splits are capped at MAX_SPLITS and at one key step each. `queries_per_group`: the call's
    max_query_len (a group's q queries x G heads are the tile's rows). `kv_fp8`: the large
    grid takes FP8_LARGE_GRID_STEP's key step, warps, stages and product order instead (the
    model-dtype cache takes RLT_SPLIT_DECODE's when it is set)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    programs = max(1, num_groups * num_kv_heads)
    small_grid = programs <= SMALL_GRID and block_d <= 128
    num_stages = 3
    step = _fp8_step if kv_fp8 else _model_dtype_step
    tuned_step = step is not None and not small_grid and block_n is None and block_d <= 128
    keys_as_rows = False
    if tuned_step:
        block_n, tuned_warps, num_stages, keys_as_rows = step
    if block_n is None:
        if small_grid:
            block_n = 16 if programs <= SMALL_GRID // 2 else 32
        else:
            block_n = 64 if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        per_sm = 6 if small_grid else 2
        num_splits = -(-per_sm * sm_count // programs)
        num_splits = min(num_splits, MAX_SPLITS, max(1, -(-max_context_len // block_n)))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # A 16-row tl.dot tile also for G == 1: on an H200 it beat vector reductions over the keys
    # (10 vs 12 us per layer at batch 1, 71 vs 120 us at batch 32; Ouro-1.4B, context 1088).
    block_m = max(16, triton.next_power_of_2(queries_per_group * queries_per_kv))
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    if small_grid:
        num_warps, num_stages = (2 if block_n == 16 else 4), 2
    if tuned_step:
        num_warps = tuned_warps
    return SplitConfig(num_splits, block_m, block_n, block_d, num_warps, num_stages, keys_as_rows)


def launch_split_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lengths: torch.Tensor,
    *,
    split: SplitConfig,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    write_slots: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    queries_per_group: int = 1,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Attention of groups of at most `queries_per_group` queries (1: decode rows), split over
    the keys; `split.block_m` must hold queries_per_group x G rows.

    Same arguments as `launch_paged_attention`. Grid (S, Hkv, num_splits) for the split kernel;
    the fp32 partials are allocated here with torch.empty (a CUDA-graph capture puts them in the
    graph's pool). No host sync.
    - new_key / new_value [N, Hkv, D] and write_slots [N]: the call's own keys and values; the
      kernel stores them (no separate store launch) and reads them from registers.
    - tickets [S, Hkv] int32, zero between calls (the kernel leaves them zero): the last split of
      each (group, kv head) to finish merges the partials itself; without tickets a combine
      kernel (S, H, queries_per_group) runs after the split kernel when num_splits > 1.
    - key_scale / value_scale (fp32 [1]): the layer's scales of an fp8 cache (read, and the
      call's own keys stored, as `kv_store.quantize` / `dequantized` do).
    The call's own keys and the fused merge need one query per group.
    """
    num_groups = context_lengths.shape[0]
    num_rows, num_heads, head_dim = query.shape
    _, page_size, kv_heads, _ = key_cache.shape
    if num_groups == 0:
        return
    num_splits = split.num_splits
    direct = num_splits == 1
    if queries_per_group > 1 and (new_key is not None or tickets is not None):
        raise ValueError("storing the call's keys or merging in the split kernel needs q_len 1")
    if queries_per_group * (num_heads // kv_heads) > split.block_m:
        raise ValueError(f"block_m {split.block_m} cannot hold {queries_per_group} queries")
    pdl = dependent_launch.enabled(query)
    if direct:
        partial_max = partial_sum = partial_acc = out  # unused
    else:
        partial_max = torch.empty(
            (num_rows, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(
            (num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
    store_new = new_key is not None
    fused_combine = tickets is not None and not direct
    if store_new:
        if new_key.stride(-1) != 1:
            new_key = new_key.contiguous()
        if new_value.stride(-1) != 1:
            new_value = new_value.contiguous()
    else:
        new_key = new_value = write_slots = query  # unused
    _split_decode_kernel[(num_groups, kv_heads, num_splits)](
        out,
        partial_max,
        partial_sum,
        partial_acc,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start,
        context_lengths,
        new_key,
        new_value,
        write_slots,
        tickets if fused_combine else context_lengths,
        query if key_scale is None else key_scale,
        query if value_scale is None else value_scale,
        head_dim**-0.5 * math.log2(math.e),
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        new_key.stride(0),
        new_key.stride(1),
        new_value.stride(0),
        new_value.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=split.block_d,
        PAGE_SIZE=page_size,
        QUERIES_PER_KV=num_heads // kv_heads,
        QUERIES_PER_GROUP=queries_per_group,
        BLOCK_M=split.block_m,
        BLOCK_N=split.block_n,
        DIRECT_OUTPUT=direct,
        STORE_NEW=store_new,
        FUSED_COMBINE=fused_combine,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        USE_PDL=pdl,
        KV_FP8=key_scale is not None,
        KEYS_AS_ROWS=split.keys_as_rows,
        num_warps=split.num_warps,
        num_stages=split.num_stages,
        **dependent_launch.launch_options(pdl),
    )
    if direct or fused_combine:
        return
    _split_combine_kernel[(num_groups, num_heads, queries_per_group)](
        out,
        partial_max,
        partial_sum,
        partial_acc,
        query_start,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=split.block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        USE_PDL=pdl,
        num_warps=1 if split.block_d * num_splits <= 2048 else 4,
        **dependent_launch.launch_options(pdl),
    )
