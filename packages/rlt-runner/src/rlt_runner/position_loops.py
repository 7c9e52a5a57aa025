"""`PositionLoops`: model calls over many token positions, each stopping at its own exit depth.

Shared by a speculative round's draft and verify (speculative_program.py) and prompt scoring at
each position's exit depth (exit_depth_prefill.py). Each token carries a `TokenState`; around
every model call a bookkeeping object (`loop_bookkeeping.TorchBookkeeping`, or the fused
`speculative_kernels.SpeculativeKernels`) says which tokens run the loop and where they write,
then applies their exit rules, copies the KV of tokens that exit at e < T into planes e..T-1
(LAST_EXITED) and advances the rest. Passes are `depth_major` (LAST_EXITED only) or
`one_position`; README.md, "Prompt chunks at exit depth", says why each equals decoding.
"""

from __future__ import annotations

import torch
from rlt_contracts import AttentionBackend, LoopedLanguageModel, PagedAttentionBatch

from rlt_runner.exit_rules import ExitRules
from rlt_runner.kv_storage import KVStorage
from rlt_runner.loop_bookkeeping import TorchBookkeeping
from rlt_runner.row_state import DecodeRows
from rlt_runner.token_state import TokenState


class PositionLoops:
    """The shared loop machinery. `bookkeeping` starts as the torch reference; an owner whose
    token counts are bounded may install the fused kernels instead (speculative rounds do).
    max_position: positions past it are clamped for RoPE (padding queries only)."""

    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        kv: KVStorage,
        rows: DecodeRows,
        *,
        max_position: int,
    ) -> None:
        self.model = model
        self.attention = attention
        self.kv = kv
        self.rows = rows
        self.depth = model.shape.num_loops
        self.max_position = max_position
        self.plane_ids = torch.arange(rows.num_planes, device=rows.device)
        max_rows = rows.hidden.shape[0]  # one query per row: query_start 0, 1, .., rows
        self.single_query_starts = torch.arange(max_rows + 1, dtype=torch.int32, device=rows.device)
        self.bookkeeping = TorchBookkeeping(self)

    def run_loop(
        self, state: TokenState, rules: ExitRules, batch: PagedAttentionBatch, gate: bool
    ) -> None:
        """One model call over `state`'s tokens (attention metadata `batch`, after a prepare),
        then the bookkeeping's decide: exit rules, LAST_EXITED copies, the state advanced."""
        hidden, gate_probability = self.model.recurrent_step(
            state.hidden,
            state.position.clamp(max=self.max_position),
            self.attention.bind(self.kv.tensors, batch),
            compute_gate=gate,
        )
        self.bookkeeping.decide(state, rules, hidden, gate_probability)

    def depth_major(
        self,
        state: TokenState,
        rules: ExitRules,
        on: torch.Tensor,
        *,
        group_tables: torch.Tensor,
        query_start: torch.Tensor,
        context_lengths: torch.Tensor,
        max_query_len: int,
        loops: range,
        gate: bool,
        max_context: int,
    ) -> None:
        """Loops `loops` (1-based) over every token of `state` (`on`: those that take part;
        `state.kv_slots` set), grouped as `query_start` [G + 1] int32 says, group g reading
        `group_tables` [G, planes, pages] up to `context_lengths[g]`. LAST_EXITED only."""
        for loop in loops:
            batch = PagedAttentionBatch(
                query_start=query_start,
                context_lengths=context_lengths,
                block_tables=group_tables[:, loop - 1],
                write_slots=self.bookkeeping.prepare_verify(state, on, loop),
                max_query_len=max_query_len,
                max_context_len=max_context,
            )
            self.run_loop(state, rules, batch, gate)

    def one_position(
        self,
        state: TokenState,
        rules: ExitRules,
        on: torch.Tensor,
        *,
        tables: torch.Tensor,
        loop_cap: int,
        iterations: int,
        gate: bool,
        max_context: int,
    ) -> None:
        """`iterations` loops of one token per group (`tables` [n, planes, pages] its row's
        block tables; `state.kv_slots` from `bookkeeping.position_slots`), for the tokens `on`
        that have not exited and have run fewer than `loop_cap` loops."""
        n = tables.shape[0]
        for _ in range(iterations):
            context, loop_tables, write_slots = self.bookkeeping.prepare_draft(
                state, on, loop_cap, tables
            )
            batch = PagedAttentionBatch(
                query_start=self.single_query_starts[: n + 1],
                context_lengths=context,
                block_tables=loop_tables,
                write_slots=write_slots,
                max_query_len=1,
                max_context_len=max_context,
            )
            self.run_loop(state, rules, batch, gate)
