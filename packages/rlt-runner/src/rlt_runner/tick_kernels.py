"""Triton kernels of the decode tick's bookkeeping (CUDA; TRITON_INTERPRET=1 for CPU tests).

The torch code of `DecodeProgram` is the reference: written as whole-batch tensor ops it costs
~100 tiny kernels per tick around the model (~0.2 ms at batch 1, a sixth of a loop). These four
kernels do the same work:

  prepare   one program for all rows: cohort release, loop index, plane, page, own / write
            slot, context length (one pass over the row state), and `coda_flag` zeroed; held
            rows (structured output) do not run
  decide    one program per row, after the loop and before the coda: the exit rule (HAZARD /
            DELAYED_HAZARD / TRACE, hazard product in fp64) into `exits`, `survival_new`,
            `pending_new`; `coda_flag` raised when some row exits (README.md, "Worked example
            1": the LM head reads no weight in ticks where it stays 0)
  commit    one program per row: stop rule, ring record (token, depth[, logprobs]), the
            exited token's output count (penalized modes: `output_counts[row, token] += 1`),
            every progress field, the LAST_EXITED copy slots, and the row's next hidden state
            (the embedded new token, the loop's output, or unchanged)
  copy      one program per (row, target plane, layer): the LAST_EXITED finalization copies

A RING layout of K planes takes plane (loop - 1) mod K in prepare; its copies are LAST_EXITED's
over K planes. Bool row buffers are passed as uint8 views (same memory).
"""

from __future__ import annotations

import os

import torch
from rlt_contracts import KVLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels on linux
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _prepare_kernel(
        active_ptr,
        parked_ptr,
        held_ptr,  # structured output: waiting for the next token mask
        loops_ptr,
        position_ptr,
        tables_ptr,  # [S, planes, pages] int32
        run_ptr,  # out [B] uint8
        loop_index_ptr,  # out [B] int64
        plane_ptr,  # out [B] int64
        page_ptr,  # out [B] int64
        own_slot_ptr,  # out [B] int64
        write_slot_ptr,  # out [B] int64
        context_ptr,  # out [B] int32
        coda_flag_ptr,  # out [1] int32: zeroed here, raised by decide when some row exits
        num_rows,
        scratch_slot,
        NUM_PLANES: tl.constexpr,
        MAX_PAGES: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        LAST_EXITED: tl.constexpr,
        RING: tl.constexpr,
        COHORT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.arange(0, BLOCK)
        valid = rows < num_rows
        active = tl.load(active_ptr + rows, mask=valid, other=0) != 0
        parked = tl.load(parked_ptr + rows, mask=valid, other=0) != 0
        held = tl.load(held_ptr + rows, mask=valid, other=0) != 0
        if COHORT:
            looping = active & (~parked) & (~held) & valid
            any_looping = tl.max(looping.to(tl.int32), axis=0) > 0
            parked = parked & any_looping
            tl.store(parked_ptr + rows, parked.to(tl.uint8), mask=valid)
        run = active & (~parked) & (~held)
        loop_index = tl.load(loops_ptr + rows, mask=valid, other=0) + 1
        if RING:
            plane = (loop_index - 1) % NUM_PLANES
        elif LAST_EXITED:
            plane = tl.minimum(loop_index - 1, NUM_PLANES - 1)
        else:
            plane = loop_index * 0
        position = tl.load(position_ptr + rows, mask=valid, other=0)
        page = tl.minimum(position // PAGE_SIZE, MAX_PAGES - 1)
        block = tl.load(
            tables_ptr + (rows * NUM_PLANES + plane) * MAX_PAGES + page, mask=valid, other=0
        ).to(tl.int64)
        own = block * PAGE_SIZE + position % PAGE_SIZE
        tl.store(run_ptr + rows, run.to(tl.uint8), mask=valid)
        tl.store(loop_index_ptr + rows, loop_index, mask=valid)
        tl.store(plane_ptr + rows, plane, mask=valid)
        tl.store(page_ptr + rows, page, mask=valid)
        tl.store(own_slot_ptr + rows, own, mask=valid)
        tl.store(write_slot_ptr + rows, tl.where(run, own, scratch_slot), mask=valid)
        tl.store(context_ptr + rows, tl.where(run, position + 1, 1).to(tl.int32), mask=valid)
        tl.store(coda_flag_ptr, 0)

    @triton.jit
    def exit_rule(
        index,
        run_ptr,
        loop_index_ptr,
        survival_ptr,
        pending_ptr,
        output_index_ptr,
        gate_ptr,
        kind_ptr,
        min_loops_ptr,
        max_loops_ptr,
        threshold_ptr,
        trace_ptr,
        trace_capacity,
        HAS_GATE: tl.constexpr,
    ):
        """Entry `index`'s exit rule after its loop (HAZARD / DELAYED_HAZARD / TRACE, hazard
        product in fp64): (runs, loop index, survival and pending exit before the loop, exits
        (only where it ran), survival and pending exit after it). The tick's and the
        speculative round's decide kernels both call it."""
        run = tl.load(run_ptr + index) != 0
        loop_index = tl.load(loop_index_ptr + index)
        survival = tl.load(survival_ptr + index)
        pending = tl.load(pending_ptr + index)
        output_index = tl.load(output_index_ptr + index)
        kind = tl.load(kind_ptr + index)
        at_max = loop_index >= tl.load(max_loops_ptr + index)
        delayed_exit = at_max | ((pending > 0) & (loop_index >= pending))
        if HAS_GATE:
            survival_new = survival * (1.0 - tl.load(gate_ptr + index).to(tl.float64))
            threshold = tl.load(threshold_ptr + index)
            triggered = (
                (threshold < 1.0)
                & (loop_index >= tl.load(min_loops_ptr + index))
                & (1.0 - survival_new >= threshold)
            )
            pending_new = tl.where((pending == 0) & triggered, loop_index + 1, pending)
            hazard_exit = at_max | triggered
        else:
            survival_new = survival
            pending_new = pending
            hazard_exit = at_max
        trace_index = tl.minimum(output_index, trace_capacity - 1)
        trace_depth = tl.load(trace_ptr + index * trace_capacity + trace_index).to(tl.int64)
        exits = tl.where(
            kind == 0, hazard_exit, tl.where(kind == 1, delayed_exit, loop_index >= trace_depth)
        )
        return run, loop_index, survival, pending, exits & run, survival_new, pending_new

    @triton.jit
    def _decide_kernel(
        run_ptr,
        loop_index_ptr,
        gate_ptr,  # [B] fp32 (unused without HAS_GATE)
        survival_ptr,
        pending_ptr,
        outputs_ptr,
        kind_ptr,
        min_loops_ptr,
        max_loops_ptr,
        threshold_ptr,
        trace_ptr,
        exits_ptr,  # out [B] uint8
        survival_new_ptr,  # out [B] fp64
        pending_new_ptr,  # out [B] int64
        coda_flag_ptr,  # [1] int32, raised to 1 when some row exits
        trace_capacity,
        HAS_GATE: tl.constexpr,
    ):
        row = tl.program_id(0)
        _, _, _, _, exits, survival_new, pending_new = exit_rule(
            row,
            run_ptr,
            loop_index_ptr,
            survival_ptr,
            pending_ptr,
            outputs_ptr,
            gate_ptr,
            kind_ptr,
            min_loops_ptr,
            max_loops_ptr,
            threshold_ptr,
            trace_ptr,
            trace_capacity,
            HAS_GATE,
        )
        tl.store(exits_ptr + row, exits.to(tl.uint8))
        tl.store(survival_new_ptr + row, survival_new)
        tl.store(pending_new_ptr + row, pending_new)
        tl.atomic_max(coda_flag_ptr, exits.to(tl.int32))

    @triton.jit
    def _commit_kernel(
        # prepare outputs
        run_ptr,
        loop_index_ptr,
        page_ptr,
        own_slot_ptr,
        # decide outputs
        exits_ptr,
        survival_new_ptr,
        pending_new_ptr,
        # loop outputs
        new_hidden_ptr,  # [B, d]
        token_ptr,  # [B] int64 sampled
        logprob_ptr,  # [B] fp32 (LOGPROBS)
        top_ids_ptr,  # [B, K] int64 (LOGPROBS)
        top_logprobs_ptr,  # [B, K] fp32 (LOGPROBS)
        embedded_ptr,  # [B, d] embeddings of the sampled tokens
        # row state
        hidden_ptr,
        tokens_ptr,
        position_ptr,
        loops_ptr,
        survival_ptr,
        pending_ptr,
        outputs_ptr,
        active_ptr,
        parked_ptr,
        held_ptr,
        hold_ptr,  # hold_after_output (structured output)
        max_tokens_ptr,
        stop_ids_ptr,
        tables_ptr,
        counts_ptr,  # [S, V] int32 output counts (PENALIZED)
        # outputs
        ring_ptr,  # [T, S, C] fp64
        tick_index_ptr,
        copy_src_ptr,  # [B, planes - 1] int64 (-1: no copy)
        copy_dst_ptr,
        hidden_size,
        num_slots,
        ring_columns,
        vocab_size,
        DEPTH: tl.constexpr,
        NUM_PLANES: tl.constexpr,
        MAX_PAGES: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        STOP_CAPACITY: tl.constexpr,
        STOP_BLOCK: tl.constexpr,
        COHORT: tl.constexpr,
        LOGPROBS: tl.constexpr,
        TOP_K: tl.constexpr,
        TOP_BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PENALIZED: tl.constexpr,
    ):
        row = tl.program_id(0)
        run = tl.load(run_ptr + row) != 0
        loop_index = tl.load(loop_index_ptr + row)
        survival = tl.load(survival_ptr + row)
        pending = tl.load(pending_ptr + row)
        outputs = tl.load(outputs_ptr + row)
        exits = tl.load(exits_ptr + row) != 0
        survival_new = tl.load(survival_new_ptr + row)
        pending_new = tl.load(pending_new_ptr + row)
        token = tl.load(token_ptr + row)
        outputs_new = outputs + exits.to(tl.int64)
        stop_offsets = tl.arange(0, STOP_BLOCK)
        stop_ids = tl.load(
            stop_ids_ptr + row * STOP_CAPACITY + stop_offsets,
            mask=stop_offsets < STOP_CAPACITY,
            other=-1,
        )
        stop_token = tl.max((stop_ids == token).to(tl.int32), axis=0) > 0
        stops = exits & (stop_token | (outputs_new >= tl.load(max_tokens_ptr + row)))
        carry = exits & (~stops)
        looping = run & (~exits)

        tick = tl.load(tick_index_ptr)
        record = ring_ptr + (tick * num_slots + row) * ring_columns
        tl.store(record, tl.where(exits, token, -1).to(tl.float64))
        tl.store(record + 1, tl.where(exits, loop_index, 0).to(tl.float64))
        if LOGPROBS:
            tl.store(record + 2, tl.load(logprob_ptr + row).to(tl.float64))
            top = tl.arange(0, TOP_BLOCK)
            in_top = top < TOP_K
            ids = tl.load(top_ids_ptr + row * TOP_K + top, mask=in_top, other=0)
            values = tl.load(top_logprobs_ptr + row * TOP_K + top, mask=in_top, other=0.0)
            tl.store(record + 3 + top, ids.to(tl.float64), mask=in_top)
            tl.store(record + 3 + TOP_K + top, values.to(tl.float64), mask=in_top)

        if PENALIZED:
            count_slot = counts_ptr + row.to(tl.int64) * vocab_size + token
            tl.store(count_slot, tl.load(count_slot) + exits.to(tl.int32))

        old_token = tl.load(tokens_ptr + row)
        tl.store(tokens_ptr + row, tl.where(exits, token, old_token))
        position = tl.load(position_ptr + row)
        tl.store(position_ptr + row, position + carry.to(tl.int64))
        old_loops = tl.load(loops_ptr + row)
        tl.store(loops_ptr + row, tl.where(exits, 0, tl.where(run, loop_index, old_loops)))
        tl.store(survival_ptr + row, tl.where(exits, 1.0, tl.where(run, survival_new, survival)))
        tl.store(pending_ptr + row, tl.where(exits, 0, tl.where(run, pending_new, pending)))
        tl.store(outputs_ptr + row, outputs_new)
        active = tl.load(active_ptr + row) != 0
        tl.store(active_ptr + row, (active & (~stops)).to(tl.uint8))
        if COHORT:
            parked = tl.load(parked_ptr + row) != 0
            tl.store(parked_ptr + row, (parked | carry).to(tl.uint8))
        held = tl.load(held_ptr + row) != 0
        hold = tl.load(hold_ptr + row) != 0
        tl.store(held_ptr + row, (held | (carry & hold)).to(tl.uint8))

        if NUM_PLANES > 1:
            page = tl.load(page_ptr + row)
            own = tl.load(own_slot_ptr + row)
            offset = own % PAGE_SIZE
            copies = exits & (loop_index < DEPTH)
            for plane in tl.static_range(1, NUM_PLANES):
                needed = copies & (loop_index <= plane)
                block = tl.load(tables_ptr + (row * NUM_PLANES + plane) * MAX_PAGES + page)
                target = block.to(tl.int64) * PAGE_SIZE + offset
                tl.store(
                    copy_src_ptr + row * (NUM_PLANES - 1) + plane - 1, tl.where(needed, own, -1)
                )
                tl.store(
                    copy_dst_ptr + row * (NUM_PLANES - 1) + plane - 1, tl.where(needed, target, -1)
                )

        for start in range(0, hidden_size, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            in_row = cols < hidden_size
            current = tl.load(hidden_ptr + row * hidden_size + cols, mask=in_row)
            computed = tl.load(new_hidden_ptr + row * hidden_size + cols, mask=in_row)
            embedded = tl.load(embedded_ptr + row * hidden_size + cols, mask=in_row)
            value = tl.where(carry, embedded, tl.where(looping, computed, current))
            tl.store(hidden_ptr + row * hidden_size + cols, value, mask=in_row)

    @triton.jit
    def _copy_kernel(
        key_ptr,  # [L, slots, width] (width = Hkv * D)
        value_ptr,
        copy_src_ptr,
        copy_dst_ptr,
        num_slots,
        width,
        BLOCK_W: tl.constexpr,
    ):
        pair = tl.program_id(0)
        layer = tl.program_id(1)
        source = tl.load(copy_src_ptr + pair)
        if source >= 0:
            target = tl.load(copy_dst_ptr + pair)
            base = layer.to(tl.int64) * num_slots
            for start in range(0, width, BLOCK_W):
                cols = start + tl.arange(0, BLOCK_W)
                inside = cols < width
                k = tl.load(key_ptr + (base + source) * width + cols, mask=inside)
                tl.store(key_ptr + (base + target) * width + cols, k, mask=inside)
                v = tl.load(value_ptr + (base + source) * width + cols, mask=inside)
                tl.store(value_ptr + (base + target) * width + cols, v, mask=inside)


def uint8_view(tensor: torch.Tensor) -> torch.Tensor:
    """A bool buffer as the kernels take it (same memory)."""
    return tensor.view(torch.uint8)


def launch_copies(kv, copy_src: torch.Tensor, copy_dst: torch.Tensor, entries: int) -> None:
    """`_copy_kernel` over the (source, target) slot pairs of `entries` rows or tokens, each
    with `planes - 1` pairs ([entries, planes - 1] int64, -1: no copy), in every layer."""
    key, value = kv.tensors.key_cache, kv.tensors.value_cache
    width = key.shape[-2] * key.shape[-1]
    _copy_kernel[(entries * copy_src.shape[1], key.shape[0])](
        key,
        value,
        copy_src,
        copy_dst,
        key.shape[1] * key.shape[2],
        width,
        BLOCK_W=min(triton.next_power_of_2(width), 2048),
    )


class TickKernels:
    """Launchers bound to one program's buffers (scratch outputs sized for every row)."""

    def __init__(self, program) -> None:
        rows = program.rows
        num_rows = rows.hidden.shape[0]
        device = rows.device
        self.program = program
        self.run = torch.zeros(num_rows, dtype=torch.uint8, device=device)
        self.loop_index = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.plane = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.page = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.own_slot = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.write_slot = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.context = torch.ones(num_rows, dtype=torch.int32, device=device)
        self.exits = torch.zeros(num_rows, dtype=torch.uint8, device=device)
        self.survival_new = torch.ones(num_rows, dtype=torch.float64, device=device)
        self.pending_new = torch.zeros(num_rows, dtype=torch.int64, device=device)
        # 1 when some row exits in this tick: the coda (LM head) is skipped otherwise
        self.coda_flag = torch.zeros(1, dtype=torch.int32, device=device)
        extra = max(rows.num_planes - 1, 1)
        self.copy_src = torch.full((num_rows, extra), -1, dtype=torch.int64, device=device)
        self.copy_dst = torch.full((num_rows, extra), -1, dtype=torch.int64, device=device)

    def prepare(self, num_rows: int) -> None:
        program, rows = self.program, self.program.rows
        _prepare_kernel[(1,)](
            uint8_view(rows.active),
            uint8_view(rows.parked),
            uint8_view(rows.held),
            rows.loops,
            rows.position,
            rows.block_tables,
            self.run,
            self.loop_index,
            self.plane,
            self.page,
            self.own_slot,
            self.write_slot,
            self.context,
            self.coda_flag,
            num_rows,
            program.kv.scratch_slot,
            NUM_PLANES=rows.num_planes,
            MAX_PAGES=rows.max_pages,
            PAGE_SIZE=program.block_size,
            LAST_EXITED=rows.num_planes > 1,
            RING=program.layout.kind is KVLayout.RING and rows.num_planes > 1,
            COHORT=program.cohort,
            BLOCK=max(triton.next_power_of_2(num_rows), 16),
        )

    def decide(self, num_rows: int, gate) -> None:
        """Each row's exit rule on this loop's gate: `exits`, the new survival and pending
        exit, and `coda_flag` raised when some row exits (before the coda, which reads it)."""
        rows = self.program.rows
        _decide_kernel[(num_rows,)](
            self.run,
            self.loop_index,
            gate if gate is not None else self.context,
            rows.survival,
            rows.pending_exit,
            rows.outputs,
            rows.rule_kind,
            rows.min_loops,
            rows.max_loops,
            rows.threshold,
            rows.trace,
            self.exits,
            self.survival_new,
            self.pending_new,
            self.coda_flag,
            rows.trace_capacity,
            HAS_GATE=gate is not None,
        )

    def commit(self, num_rows: int, new_hidden, sampled, embedded, mode) -> None:
        program, rows = self.program, self.program.rows
        logprobs = mode.top_logprobs is not None
        top_k = mode.top_logprobs or 1
        _commit_kernel[(num_rows,)](
            self.run,
            self.loop_index,
            self.page,
            self.own_slot,
            self.exits,
            self.survival_new,
            self.pending_new,
            new_hidden,
            sampled.token_ids,
            sampled.logprobs if logprobs else self.context,
            sampled.top_token_ids if logprobs else self.loop_index,
            sampled.top_logprobs if logprobs else self.context,
            embedded,
            rows.hidden,
            rows.token,
            rows.position,
            rows.loops,
            rows.survival,
            rows.pending_exit,
            rows.outputs,
            uint8_view(rows.active),
            uint8_view(rows.parked),
            uint8_view(rows.held),
            uint8_view(rows.hold_after_output),
            rows.max_tokens,
            rows.stop_ids,
            rows.block_tables,
            rows.logits_state.output_counts if mode.penalized else self.context,
            program.ring,
            program.tick_index,
            self.copy_src,
            self.copy_dst,
            rows.hidden.shape[1],
            program.ring.shape[1],
            program.ring.shape[2],
            rows.logits_state.vocab_size,
            DEPTH=program.depth,
            NUM_PLANES=rows.num_planes,
            MAX_PAGES=rows.max_pages,
            PAGE_SIZE=program.block_size,
            STOP_CAPACITY=rows.stop_capacity,
            STOP_BLOCK=max(triton.next_power_of_2(max(rows.stop_capacity, 1)), 2),
            COHORT=program.cohort,
            LOGPROBS=logprobs,
            TOP_K=top_k,
            TOP_BLOCK=max(triton.next_power_of_2(top_k), 2),
            BLOCK_D=min(triton.next_power_of_2(rows.hidden.shape[1]), 1024),
            PENALIZED=mode.penalized,
        )

    def copy(self, num_rows: int) -> None:
        if self.program.rows.num_planes > 1:
            launch_copies(self.program.kv, self.copy_src, self.copy_dst, num_rows)
