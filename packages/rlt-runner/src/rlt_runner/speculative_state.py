"""The per-round views a speculative round works with (speculative_program.py).

`Slots`: what a round reads of its rows once, at its start (gathered copies, so the round's
own writes to the rows happen only at its end). `TokenState`: the loop progress and exit state
of one position per slot (the draft, SHARED's verify) or of every position (LAST_EXITED's
verify), advanced loop by loop with masked updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlt_runner.exit_rules import ExitDecision, ExitRules
from rlt_runner.row_state import DecodeRows

if TYPE_CHECKING:
    from rlt_runner.speculative_program import SpeculativeProgram


@dataclass(frozen=True)
class Slots:
    """Slots [0, count) of a round: their rows (`index`), whether each takes part (`live`: a
    valid slot whose row is active and not held), how many drafts it makes (`drafted`: the
    rule's count, capped so that every emitted token fits max_tokens; 0 when not live), which
    of its K + 1 positions are valid (`position_valid` [n, K + 1]: 0 .. drafted), the position
    and output index of its current token, its exit rules and its block tables."""

    index: torch.Tensor
    live: torch.Tensor
    drafted: torch.Tensor
    position_valid: torch.Tensor
    position: torch.Tensor
    outputs: torch.Tensor
    rules: ExitRules
    tables: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    @classmethod
    def gather(cls, rows: DecodeRows, program: SpeculativeProgram, count: int) -> Slots:
        index = program.slot_row[:count]
        live = program.slot_valid[:count] & rows.active[index] & ~rows.held[index]
        outputs = rows.outputs[index]
        room = (rows.max_tokens[index] - outputs - 1).clamp(min=0)
        drafted = torch.minimum(rows.speculative_tokens[index], room)
        drafted = torch.where(live, drafted.clamp(max=program.num_drafts), 0)
        valid = live[:, None] & (program.offsets[None, :] <= drafted[:, None])
        return cls(
            index=index,
            live=live,
            drafted=drafted,
            position_valid=valid,
            position=rows.position[index],
            outputs=outputs,
            rules=ExitRules.of_rows(rows, index),
            tables=rows.block_tables[index],
        )


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

    # -- the program's position buffers [L, K + 1, ...] ----------------------------------------
    def store(self, program: SpeculativeProgram, count: int, column: int) -> None:
        """Write this one-position-per-slot state into column `column` of slots [0, count)."""
        for name in _BUFFERS:
            getattr(program, _BUFFERS[name])[:count, column] = getattr(self, name)

    def store_all(self, program: SpeculativeProgram, count: int) -> None:
        """Write this every-position state ([count * (K + 1)], row-major) back."""
        width = program.width
        for name in _BUFFERS:
            value = getattr(self, name)
            target = getattr(program, _BUFFERS[name])[:count]
            target.copy_(value.view(count, width, *value.shape[1:]))

    @classmethod
    def load_column(cls, program: SpeculativeProgram, count: int, column: int) -> TokenState:
        """Column `column` of slots [0, count), copied (the fused kernels update in place)."""
        return cls._from(program, lambda buffer: buffer[:count, column].clone(), column, count)

    @classmethod
    def load(cls, program: SpeculativeProgram, count: int) -> TokenState:
        """Every position of slots [0, count), row-major."""
        return cls._from(program, lambda buffer: buffer[:count].flatten(0, 1), None, count)

    @classmethod
    def _from(cls, program, take, column: int | None, count: int) -> TokenState:
        rows = program.rows
        index = program.slot_row[:count]
        base_position = rows.position[index][:, None] + program.offsets
        base_output = rows.outputs[index][:, None] + program.offsets
        if column is None:
            position, output = base_position.reshape(-1), base_output.reshape(-1)
        else:
            position = base_position[:, column].contiguous()
            output = base_output[:, column].contiguous()
        values = {name: take(getattr(program, buffer)) for name, buffer in _BUFFERS.items()}
        return cls(position=position, output_index=output, **values)


# TokenState field -> SpeculativeProgram buffer
_BUFFERS = {
    "hidden": "hidden",
    "loops": "loops",
    "survival": "survival",
    "pending": "pending",
    "exited": "exited",
    "depth": "depths",
}
