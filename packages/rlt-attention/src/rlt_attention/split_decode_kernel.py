"""Triton split-KV ("flash-decoding") paged attention for calls whose groups have one query
(decode rows) or a few (max_query_len x G <= `triton_backend.SPLIT_TILE_ROWS`: the positions a
speculative round verifies).

The split kernel runs a (group, kv head, split) grid and writes an fp32 partial per query row
and head (running max, sum of exponentials, unnormalised accumulator), or, with one split, the
output itself; the combine kernel merges the partials. The tile's rows are the group's (query,
head) pairs, so each key is loaded once for all of them. README.md ("Backends and
capabilities", "Split-KV for groups of a few queries") gives the split ranges, the causal mask,
sliding windows and the optional in-kernel store and merge.

Importing this module decorates the kernels: on a machine without CUDA set TRITON_INTERPRET=1
before importing it to run them (slowly) on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from rlt_contracts.dependent_launch import launch_options

from rlt_attention import grid_dependency, triton_kernel
from rlt_attention.grid_dependency import wait_for_prior_grid
from rlt_attention.split_config import SplitConfig
from rlt_attention.split_decode_vector import split_decode_vector_kernel
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
    WINDOW: tl.constexpr,  # > 0: sliding window (row at p sees keys p - WINDOW + 1 .. p)
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
    keys_begin = 0  # the first key any of the group's queries sees
    if WINDOW > 0:
        keys_begin = tl.maximum(context_len - query_len - WINDOW + 1, 0)
    per_split = (context_len - keys_begin + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    key_start = keys_begin + split * split_len
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
            if WINDOW > 0:
                visible_t = visible_t & (key_position[:, None] > row_position[None, :] - WINDOW)
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
            if WINDOW > 0:
                visible = visible & (key_position[None, :] > row_position[:, None] - WINDOW)
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
    window: int | None = None,
) -> None:
    """Attention of groups of at most `queries_per_group` queries (1: decode rows), split over
    the keys; `split.block_m` must hold queries_per_group x G rows. `window` W: the query at
    position p sees keys p - W + 1 .. p only, and the splits cover only the keys the group's
    queries see (each W compiles its own kernels; None the unwindowed ones).

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
    pdl = grid_dependency.enabled(query)
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
    # the arguments both split kernels take
    tensors = (out, partial_max, partial_sum, partial_acc, query, key_cache, value_cache)
    tensors += (block_tables, query_start, context_lengths)
    scales = triton_kernel.scale_arguments(query, key_scale, value_scale)
    scalars = (head_dim**-0.5 * math.log2(math.e), num_splits)
    strides = triton_kernel.read_strides(query, out, key_cache, value_cache, block_tables)
    options = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=split.block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=split.block_n,
        DIRECT_OUTPUT=direct,
        USE_PDL=pdl,
        KV_FP8=key_scale is not None,
        WINDOW=window or 0,
        num_warps=split.num_warps,
        num_stages=split.num_stages,
        **launch_options(pdl),
    )
    if split.product == "vector":
        if queries_per_group * (num_heads // kv_heads) != 1 or store_new or tickets is not None:
            raise ValueError(
                "the vector product needs one query row per (group, kv head) and no in-kernel "
                "store or merge"
            )
        split_decode_vector_kernel[(num_groups, kv_heads, num_splits)](
            *tensors, *scales, *scalars, *strides, **options
        )
        if not direct:
            _launch_combine(out, partial_max, partial_sum, partial_acc, query_start, 1, split, pdl)
        return
    if store_new:
        new_key = triton_kernel.unit_last_stride(new_key)
        new_value = triton_kernel.unit_last_stride(new_value)
    else:
        new_key = new_value = write_slots = query  # unused
    _split_decode_kernel[(num_groups, kv_heads, num_splits)](
        *tensors,
        new_key,
        new_value,
        write_slots,
        tickets if fused_combine else context_lengths,
        *scales,
        *scalars,
        *strides,
        *new_key.stride()[:2],
        *new_value.stride()[:2],
        QUERIES_PER_KV=num_heads // kv_heads,
        QUERIES_PER_GROUP=queries_per_group,
        BLOCK_M=split.block_m,
        STORE_NEW=store_new,
        FUSED_COMBINE=fused_combine,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        KEYS_AS_ROWS=split.product == "keys_by_rows",
        **options,
    )
    if direct or fused_combine:
        return
    _launch_combine(
        out, partial_max, partial_sum, partial_acc, query_start, queries_per_group, split, pdl
    )


def _launch_combine(
    out, partial_max, partial_sum, partial_acc, query_start, queries_per_group, split, pdl
) -> None:
    """Merge the splits' partials of every (query row, head) into `out`: grid (groups, heads,
    the groups' most queries)."""
    num_groups = query_start.shape[0] - 1
    _, num_heads, num_splits = partial_max.shape
    head_dim = partial_acc.shape[-1]
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
        **launch_options(pdl),
    )
