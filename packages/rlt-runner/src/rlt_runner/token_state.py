"""`TokenState`: the loop progress and exit state of the tokens a `PositionLoops` pass runs.

One entry per token (a position of a prompt being scored at exit depth, or of a speculative
round's draft or verify), advanced loop by loop with masked updates: the bookkeeping's `decide`
(loop_bookkeeping.py, or the fused speculative_kernels.py) applies the exit rules to the loop
that ran and calls `advance`. Nothing here knows who owns the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_runner.exit_rules import ExitDecision


@dataclass
class TokenState:
    """Per token: hidden [N, d] (the next loop's input, or the exit state), loops run, hazard
    survival (fp64), delayed-exit loop, exited flag and exit depth, position and the output
    index it produces; kv_slots [N, planes]: its position's KV slot in every plane (set by
    the program, which knows the tables)."""

    hidden: torch.Tensor
    loops: torch.Tensor
    survival: torch.Tensor
    pending: torch.Tensor
    position: torch.Tensor
    output_index: torch.Tensor
    exited: torch.Tensor | None = None
    depth: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.exited is None:
            self.exited = torch.zeros_like(self.loops, dtype=torch.bool)
        if self.depth is None:
            self.depth = torch.zeros_like(self.loops)

    @classmethod
    def fresh(
        cls, embedded: torch.Tensor, position: torch.Tensor, output_index: torch.Tensor
    ) -> TokenState:
        """A token that has not looped yet (its embedding as the first loop's input)."""
        return cls(
            hidden=embedded,
            loops=torch.zeros_like(position),
            survival=torch.ones_like(position, dtype=torch.float64),
            pending=torch.zeros_like(position),
            position=position,
            output_index=output_index,
        )

    def advance(
        self,
        runs: torch.Tensor,
        exits: torch.Tensor,
        loop_index: torch.Tensor,
        hidden: torch.Tensor,
        decision: ExitDecision,
    ) -> None:
        """The tokens that ran (`runs`) take the loop's state; those that exit are done."""
        self.hidden = torch.where(runs[:, None], hidden, self.hidden)
        self.survival = torch.where(runs, decision.survival, self.survival)
        self.pending = torch.where(runs, decision.pending_exit, self.pending)
        self.loops = torch.where(runs, loop_index, self.loops)
        self.depth = torch.where(exits, loop_index, self.depth)
        self.exited = self.exited | exits
