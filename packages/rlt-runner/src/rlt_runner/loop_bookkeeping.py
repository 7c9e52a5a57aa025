"""The per-loop bookkeeping of `PositionLoops` in whole-batch torch ops: the reference (CPU,
prompt scoring at exit depth, and what `speculative_kernels.SpeculativeKernels`, the fused
version a speculative round installs, is tested against).

Around each model call of a loop a bookkeeping object:

  prepare_verify(state, on, loop) -> write slots            every position at loop `loop`
                                                            (depth-major passes)
  prepare_draft(state, on, cap, tables) -> (context lengths, block-table rows, write slots)
                                                            each position at its next loop
                                                            (one-position passes)
  decide(state, rules, hidden, gate)    the exit rule, LAST_EXITED copies, the state advanced
  position_slots(tables, position)      each position's KV slot in every plane (a one-position
                                        pass)

`in_place` says whether `decide` writes the `TokenState` tensors in place (the kernels) or
rebinds them (this class: a speculative round then stores them back).
"""

from __future__ import annotations

import torch

from rlt_runner.exit_rules import ExitRules, apply_exit_rules
from rlt_runner.token_state import TokenState


def kv_slots_of(tables: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, planes] int64: the KV slot of each token's position in every plane of its table
    rows `tables` [N, planes, pages] (pages past the table clamp to its last)."""
    count, planes, pages = tables.shape
    page = (position // block_size).clamp(max=pages - 1)
    blocks = tables.gather(2, page.view(count, 1, 1).expand(count, planes, 1)).squeeze(2)
    return blocks.to(torch.int64) * block_size + (position % block_size)[:, None]


class TorchBookkeeping:
    in_place = False

    def __init__(self, loops) -> None:
        self.loops = loops  # the PositionLoops it serves: kv, rows, depth, plane_ids
        self.runs: torch.Tensor | None = None  # between prepare and decide
        self.loop_index: torch.Tensor | None = None

    def prepare_verify(self, state: TokenState, on: torch.Tensor, loop: int) -> torch.Tensor:
        self.runs = on & ~state.exited & (state.loops == loop - 1)
        self.loop_index = torch.full_like(state.loops, loop)
        scratch = self.loops.kv.scratch_slot
        return torch.where(self.runs, state.kv_slots[:, loop - 1], scratch)

    def prepare_draft(self, state: TokenState, on: torch.Tensor, cap: int, tables: torch.Tensor):
        loops = self.loops
        n, _, pages = tables.shape
        self.runs = on & ~state.exited & (state.loops < cap)
        self.loop_index = state.loops + 1
        if loops.rows.num_planes > 1:
            plane = (self.loop_index - 1).clamp(max=loops.rows.num_planes - 1)
        else:
            plane = torch.zeros_like(self.loop_index)
        loop_tables = tables.gather(1, plane.view(n, 1, 1).expand(n, 1, pages)).squeeze(1)
        own = state.kv_slots.gather(1, plane[:, None]).squeeze(1)
        context = torch.where(self.runs, state.position + 1, 1).to(torch.int32)
        return context, loop_tables, torch.where(self.runs, own, loops.kv.scratch_slot)

    def position_slots(self, tables: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return kv_slots_of(tables, position, self.loops.kv.block_size)

    def decide(
        self, state: TokenState, rules: ExitRules, hidden: torch.Tensor, gate: torch.Tensor | None
    ) -> None:
        """The exit rules on the loop that ran, the KV of tokens that exit copied into the
        deeper planes (LAST_EXITED), and the running tokens' state advanced."""
        runs, loop_index = self.runs, self.loop_index
        decision = apply_exit_rules(
            rules,
            loop_index,
            gate,
            survival=state.survival,
            pending_exit=state.pending,
            output_index=state.output_index,
        )
        exits = decision.exits & runs
        if self.loops.rows.num_planes > 1:
            self._finalize(state.kv_slots, exits, loop_index)
        state.advance(runs, exits, loop_index, hidden, decision)

    def _finalize(self, kv_slots, exits, loop_index) -> None:
        """A token exiting at loop e < T gets its plane e-1 KV copied into planes e..T-1
        (kv_slots [N, planes] of each token's position)."""
        loops = self.loops
        scratch = loops.kv.scratch_slot
        copies = exits & (loop_index < loops.depth)
        deeper = loops.plane_ids[None, 1:] >= loop_index[:, None]  # [N, planes - 1]
        needed = copies[:, None] & deeper
        own = kv_slots.gather(1, (loop_index - 1).clamp(min=0)[:, None])
        sources = torch.where(needed, own, scratch)
        targets = torch.where(needed, kv_slots[:, 1:], scratch)
        loops.kv.copy_slots(sources.reshape(-1), targets.reshape(-1))
