"""Split-KV decode attention for one query row per (group, kv head), without tensor cores: the
`vector` product of `SplitConfig` (README.md, "Backends and capabilities", fp8 KV: what it does,
why and what it measured). Its partials (or, with one split, the output) have the layout of the
tensor-core kernel, so the same combine kernel merges them. With a sliding window W the splits
cover only the row's last W positions, all of which it sees: no mask beyond the split's range.

Importing this module decorates the kernel: on a machine without CUDA set TRITON_INTERPRET=1
before importing it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlt_attention.grid_dependency import wait_for_prior_grid


@triton.jit
def split_decode_vector_kernel(
    out_ptr,  # [N, H, D] query dtype (written only when DIRECT_OUTPUT)
    partial_max_ptr,  # [N, H, num_splits] fp32, log2 units (unused when DIRECT_OUTPUT)
    partial_sum_ptr,  # [N, H, num_splits] fp32
    partial_acc_ptr,  # [N, H, num_splits, HEAD_DIM] fp32, unnormalised
    query_ptr,  # [N, H, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D] of one layer, cache dtype
    value_cache_ptr,  # same layout as key_cache_ptr
    block_tables_ptr,  # [S, max_pages] int32
    query_start_ptr,  # [S + 1] int32: one query row per group (or none: padding)
    context_lengths_ptr,  # [S] int32
    key_scale_ptr,  # fp32 [1] (KV_FP8): the layer's key scale
    value_scale_ptr,  # fp32 [1] (KV_FP8): the layer's value scale
    scale_log2,  # D^-0.5 * log2(e)
    num_splits,  # host int: splits per (group, head) = grid axis 2
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key positions per step
    DIRECT_OUTPUT: tl.constexpr,  # num_splits == 1: normalise and write the output here
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch
    KV_FP8: tl.constexpr,  # the cache is e4m3 with per-layer scales
    WINDOW: tl.constexpr,  # > 0: sliding window (the row at p sees keys p - WINDOW + 1 .. p)
):
    if USE_PDL:
        wait_for_prior_grid()
    group = tl.program_id(0)
    head = tl.program_id(1)  # = kv head (G = 1)
    split = tl.program_id(2)
    query_begin = tl.load(query_start_ptr + group)
    if tl.load(query_start_ptr + group + 1) == query_begin:
        return  # padding group without a query row
    context_len = tl.load(context_lengths_ptr + group)
    keys_begin = 0  # the first key the row sees (its position is context_len - 1)
    if WINDOW > 0:
        keys_begin = tl.maximum(context_len - WINDOW, 0)
    per_split = (context_len - keys_begin + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    key_start = keys_begin + split * split_len
    key_end = tl.minimum(key_start + split_len, context_len)

    offs_d = tl.arange(0, BLOCK_D)
    dim_valid = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + group * stride_table_group
    row = query_begin.to(tl.int64)
    if KV_FP8:  # the key scale folds into the query once
        scale_log2 = scale_log2 * tl.load(key_scale_ptr)
    q = tl.load(
        query_ptr + row * stride_query_row + head * stride_query_head + offs_d,
        mask=dim_valid,
        other=0.0,
    )
    q = q.to(tl.float32) * scale_log2  # scores come out in log2 units
    row_max = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    lane_sum = tl.zeros([BLOCK_N], tl.float32)  # per key lane; summed after the loop
    lane_acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for key_begin in range(key_start, key_end, BLOCK_N):
        key_position = key_begin + offs_n
        key_valid = key_position < key_end  # position key_begin always is: the max is finite
        block = tl.load(table_row + key_position // PAGE_SIZE, mask=key_valid, other=0)
        block = block.to(tl.int64)
        offset = key_position % PAGE_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        key_row = block * stride_key_block + offset * stride_key_offset + head * stride_key_head
        k = tl.load(key_cache_ptr + key_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(tl.float16)  # e4m3 widens to fp16 in one instruction per pair
        scores = tl.sum(k.to(tl.float32) * q[None, :], 1)  # [BLOCK_N]
        scores = tl.where(key_valid, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 0))
        correction = tl.exp2(row_max - new_max)  # 0 on the first step (row_max -inf)
        probs = tl.exp2(scores - new_max)
        lane_sum = lane_sum * correction + probs
        value_row = (
            block * stride_value_block + offset * stride_value_offset + head * stride_value_head
        )
        v = tl.load(value_cache_ptr + value_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(tl.float16)
        lane_acc = lane_acc * correction + v.to(tl.float32) * probs[:, None]
        row_max = new_max
    row_sum = tl.sum(lane_sum, 0)
    acc = tl.sum(lane_acc, 0)  # [BLOCK_D]
    if KV_FP8:  # partials merge linearly: each split's accumulator carries the value scale
        acc = acc * tl.load(value_scale_ptr)
    if DIRECT_OUTPUT:
        tl.store(
            out_ptr + row * stride_out_row + head * stride_out_head + offs_d,
            (acc / row_sum).to(out_ptr.dtype.element_ty),
            mask=dim_valid,
        )
    else:
        partial = (row * tl.num_programs(1) + head) * num_splits + split
        tl.store(partial_max_ptr + partial, row_max)
        tl.store(partial_sum_ptr + partial, row_sum)
        tl.store(partial_acc_ptr + partial * HEAD_DIM + offs_d, acc, mask=dim_valid)
