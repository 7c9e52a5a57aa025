"""Triton kernels of a speculative round's per-loop bookkeeping (CUDA; TRITON_INTERPRET=1 on CPU).

The torch bookkeeping (loop_bookkeeping.py) is the reference; README.md, "Speculative rounds",
says what the kernels replace and what they saved. They do the same work:

  prepare  one program per token, before the model call: whether it runs this loop, its loop
           index, its KV write slot (the scratch slot when it does not run); for a draft loop
           (one position per slot, each at its own loop) also its KV slot in every plane, its
           context length and its block-table row at the loop's plane
  decide   one program per token, after the model call: the exit rule (the tick's
           `tick_kernels.exit_rule`), the token's state advanced in place
           (hidden, loops, survival, pending, exited, depth) and, under LAST_EXITED, the
           (source, target) slot pairs of its finalization copies (-1: none)
  copy     `tick_kernels.launch_copies` over those pairs

The kernels write the `TokenState` tensors in place, so the program gives them tensors of their
own (never a strided view of its buffers).
"""

from __future__ import annotations

import torch

from rlt_runner import tick_kernels
from rlt_runner.exit_rules import ExitRules

triton = tick_kernels.triton
if triton is not None:
    import triton.language as tl

    from rlt_runner.tick_kernels import exit_rule

    @triton.jit
    def _prepare_kernel(
        on_ptr,  # [N] uint8: the position takes part in the round
        exited_ptr,  # [N] uint8
        loops_ptr,  # [N] int64 loops run so far
        position_ptr,  # [N] int64
        kv_slots_ptr,  # [N, NUM_PLANES] int64 (in for verify, out for a draft loop)
        tables_ptr,  # [N, NUM_PLANES, MAX_PAGES] int32 (draft loop only)
        run_ptr,  # out [N] uint8
        loop_index_ptr,  # out [N] int64
        write_slot_ptr,  # out [N] int64
        context_ptr,  # out [N] int32 (draft loop only)
        loop_tables_ptr,  # out [N, MAX_PAGES] int32 (draft loop only)
        loop,  # verify: the loop every running position runs; draft: the loop cap
        scratch_slot,
        NUM_PLANES: tl.constexpr,
        MAX_PAGES: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        LAST_EXITED: tl.constexpr,
        VERIFY: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        token = tl.program_id(0)
        on = tl.load(on_ptr + token) != 0
        exited = tl.load(exited_ptr + token) != 0
        loops = tl.load(loops_ptr + token)
        if VERIFY:  # depth-major: every position at loop `loop`, its slots already known
            run = on & (~exited) & (loops == loop - 1)
            loop_index = loops * 0 + loop
            own = tl.load(kv_slots_ptr + token * NUM_PLANES + loop - 1)
        else:  # a draft loop: each position at its own next loop, up to the cap
            run = on & (~exited) & (loops < loop)
            loop_index = loops + 1
            if LAST_EXITED:
                plane = tl.minimum(loop_index - 1, NUM_PLANES - 1)
            else:
                plane = loop_index * 0
            position = tl.load(position_ptr + token)
            page = tl.minimum(position // PAGE_SIZE, MAX_PAGES - 1)
            offset = position % PAGE_SIZE
            table = tables_ptr + token * NUM_PLANES * MAX_PAGES
            for p in tl.static_range(NUM_PLANES):
                block = tl.load(table + p * MAX_PAGES + page).to(tl.int64)
                tl.store(kv_slots_ptr + token * NUM_PLANES + p, block * PAGE_SIZE + offset)
            own = tl.load(table + plane * MAX_PAGES + page).to(tl.int64) * PAGE_SIZE + offset
            tl.store(context_ptr + token, tl.where(run, position + 1, 1).to(tl.int32))
            for start in range(0, MAX_PAGES, BLOCK_P):
                pages = start + tl.arange(0, BLOCK_P)
                inside = pages < MAX_PAGES
                row = tl.load(table + plane * MAX_PAGES + pages, mask=inside)
                tl.store(loop_tables_ptr + token * MAX_PAGES + pages, row, mask=inside)
        tl.store(run_ptr + token, run.to(tl.uint8))
        tl.store(loop_index_ptr + token, loop_index)
        tl.store(write_slot_ptr + token, tl.where(run, own, scratch_slot))

    @triton.jit
    def _decide_kernel(
        run_ptr,
        loop_index_ptr,
        gate_ptr,  # [N] fp32 (HAS_GATE)
        survival_ptr,  # [N] fp64, in place
        pending_ptr,  # [N] int64, in place
        loops_ptr,  # [N] int64, in place
        depth_ptr,  # [N] int64, in place
        exited_ptr,  # [N] uint8, in place
        output_index_ptr,
        kind_ptr,
        min_loops_ptr,
        max_loops_ptr,
        threshold_ptr,
        trace_ptr,  # [N, trace_capacity] int8
        new_hidden_ptr,  # [N, d] the loop's output
        hidden_ptr,  # [N, d], in place
        kv_slots_ptr,  # [N, NUM_PLANES] int64
        copy_src_ptr,  # out [N, NUM_PLANES - 1] int64 (-1: no copy)
        copy_dst_ptr,
        hidden_size,
        trace_capacity,
        HAS_GATE: tl.constexpr,
        DEPTH: tl.constexpr,
        NUM_PLANES: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        run, loop_index, survival, pending, exits, survival_new, pending_new = exit_rule(
            token,
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
            HAS_GATE,
        )
        tl.store(survival_ptr + token, tl.where(run, survival_new, survival))
        tl.store(pending_ptr + token, tl.where(run, pending_new, pending))
        tl.store(loops_ptr + token, tl.where(run, loop_index, tl.load(loops_ptr + token)))
        tl.store(depth_ptr + token, tl.where(exits, loop_index, tl.load(depth_ptr + token)))
        exited = tl.load(exited_ptr + token) != 0
        tl.store(exited_ptr + token, (exited | exits).to(tl.uint8))
        if NUM_PLANES > 1:  # LAST_EXITED: planes loop_index .. T - 1 take this loop's KV
            slots = kv_slots_ptr + token * NUM_PLANES
            own = tl.load(slots + tl.maximum(loop_index - 1, 0))
            copies = exits & (loop_index < DEPTH)
            for plane in tl.static_range(1, NUM_PLANES):
                needed = copies & (plane >= loop_index)
                pair = token * (NUM_PLANES - 1) + plane - 1
                tl.store(copy_src_ptr + pair, tl.where(needed, own, -1))
                tl.store(copy_dst_ptr + pair, tl.where(needed, tl.load(slots + plane), -1))
        if run:
            for start in range(0, hidden_size, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                inside = cols < hidden_size
                computed = tl.load(new_hidden_ptr + token * hidden_size + cols, mask=inside)
                tl.store(hidden_ptr + token * hidden_size + cols, computed, mask=inside)


available = tick_kernels.available


def _check_dense(state) -> None:
    """The kernels index tokens densely: a strided view would read other tokens' state."""
    for name in (
        "hidden",
        "loops",
        "survival",
        "pending",
        "exited",
        "depth",
        "position",
        "output_index",
        "kv_slots",
    ):
        if not getattr(state, name).is_contiguous():
            raise ValueError(f"TokenState.{name} must be contiguous for the fused kernels")


class SpeculativeKernels:
    """Launchers with outputs sized for every token of a round (slots x (K + 1)); the same
    interface as `loop_bookkeeping.TorchBookkeeping`, updating the state in place."""

    in_place = True

    def __init__(self, program) -> None:
        rows = program.rows
        tokens = program.max_slots * program.width
        device = rows.device
        self.program = program
        self.run = torch.zeros(tokens, dtype=torch.uint8, device=device)
        self.loop_index = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.write_slot = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.context = torch.ones(tokens, dtype=torch.int32, device=device)
        self.loop_tables = torch.zeros(tokens, rows.max_pages, dtype=torch.int32, device=device)
        extra = max(rows.num_planes - 1, 1)
        self.copy_src = torch.full((tokens, extra), -1, dtype=torch.int64, device=device)
        self.copy_dst = torch.full((tokens, extra), -1, dtype=torch.int64, device=device)

    def prepare_verify(self, state, on, loop: int) -> torch.Tensor:
        """Every position at loop `loop` (kv_slots given): the write slots."""
        count = self._prepare(state, on, loop, None)
        return self.write_slot[:count]

    def prepare_draft(self, state, on, cap: int, tables: torch.Tensor):
        """Each position at its next loop up to `cap` (`tables` [N, planes, pages] of each
        token's row): kv_slots written; (context lengths, block-table rows, write slots)."""
        count = self._prepare(state, on.contiguous(), cap, tables)
        return self.context[:count], self.loop_tables[:count], self.write_slot[:count]

    def position_slots(self, tables: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """A buffer for the positions' slots in every plane, which `prepare_draft` fills."""
        return torch.empty(tables.shape[:2], dtype=torch.int64, device=tables.device)

    def _prepare(self, state, on, loop: int, tables: torch.Tensor | None) -> int:
        program, rows = self.program, self.program.rows
        _check_dense(state)
        count = state.loops.shape[0]
        verify = tables is None
        _prepare_kernel[(count,)](
            tick_kernels.uint8_view(on),
            tick_kernels.uint8_view(state.exited),
            state.loops,
            state.position,
            state.kv_slots,
            self.loop_tables if verify else tables,
            self.run,
            self.loop_index,
            self.write_slot,
            self.context,
            self.loop_tables,
            loop,
            program.kv.scratch_slot,
            NUM_PLANES=rows.num_planes,
            MAX_PAGES=rows.max_pages,
            PAGE_SIZE=program.kv.block_size,
            LAST_EXITED=rows.num_planes > 1,
            VERIFY=verify,
            BLOCK_P=min(triton.next_power_of_2(rows.max_pages), 1024),
        )
        return count

    def decide(self, state, rules: ExitRules, hidden: torch.Tensor, gate) -> None:
        """The exit rule after this loop, the state advanced in place, then the copies."""
        program, rows = self.program, self.program.rows
        count, hidden_size = hidden.shape
        _decide_kernel[(count,)](
            self.run,
            self.loop_index,
            gate if gate is not None else self.context,
            state.survival,
            state.pending,
            state.loops,
            state.depth,
            tick_kernels.uint8_view(state.exited),
            state.output_index,
            rules.kind,
            rules.min_loops,
            rules.max_loops,
            rules.threshold,
            rules.trace,
            hidden,
            state.hidden,
            state.kv_slots,
            self.copy_src,
            self.copy_dst,
            hidden_size,
            rules.trace.shape[1],
            HAS_GATE=gate is not None,
            DEPTH=program.depth,
            NUM_PLANES=rows.num_planes,
            BLOCK_D=min(triton.next_power_of_2(hidden_size), 1024),
        )
        if rows.num_planes > 1:
            tick_kernels.launch_copies(program.kv, self.copy_src, self.copy_dst, count)
