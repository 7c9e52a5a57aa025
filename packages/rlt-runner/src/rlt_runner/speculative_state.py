"""The per-round views a speculative round works with (speculative_program.py).

`RoundState`: what the round's phases outside the program (the views here, acceptance in
speculative_accept.py) read and write of the program that runs the round. `SpeculativeProgram`
is its one implementation; the protocol sits here, below both, so neither module imports the
program that imports them. `Slots`: what a round reads of its rows once, at its start (gathered
copies, so the round's own writes to the rows happen only at its end). The `TokenState`
(token_state.py) of one position per slot (the draft, SHARED's verify) or of every position
(LAST_EXITED's verify) is stored into and loaded from the position buffers [L, K + 1, ...] by
the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from rlt_contracts import LoopedLanguageModel, SpeculativeSampler

from rlt_runner.exit_rules import ExitRules
from rlt_runner.row_state import DecodeRows
from rlt_runner.token_state import TokenState


class RoundState(Protocol):
    """A speculative round's device state, owned by `SpeculativeProgram` (its module doc and
    the runner's README say who writes what). L slots, K drafts, R rounds per step."""

    rows: DecodeRows
    model: LoopedLanguageModel
    sampler: SpeculativeSampler
    num_drafts: int  # K
    width: int  # K + 1 positions per slot
    cohort: bool  # rows that carry on park until their cohort drains
    forcing: bool  # benchmarks: accepted counts drawn on the host (`forced_accepted`)
    slot_row: torch.Tensor  # [L] int64: each slot's row
    slot_valid: torch.Tensor  # [L] bool
    offsets: torch.Tensor  # [K + 1] int64: 0 .. K
    # position buffers [L, K + 1, ...]
    hidden: torch.Tensor
    token: torch.Tensor
    loops: torch.Tensor
    survival: torch.Tensor  # fp64
    pending: torch.Tensor
    exited: torch.Tensor
    depths: torch.Tensor
    # records of the step's rounds, read back once
    ring: torch.Tensor  # [(R + 2) (K + 1), L, columns] fp64
    counts: torch.Tensor  # [R + 2, L, 2] fp64: (accepted, drafted)
    round_index: torch.Tensor  # [1] int64
    forced_accepted: torch.Tensor  # [R + 2, L] int64

    def draft_probabilities_buffer(self) -> torch.Tensor: ...


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
    def gather(cls, rows: DecodeRows, program: RoundState, count: int) -> Slots:
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


# -- token states in the program's position buffers [L, K + 1, ...] ---------------------------
def store_column(state: TokenState, program: RoundState, count: int, column: int) -> None:
    """Write a one-position-per-slot `state` into column `column` of slots [0, count)."""
    for name in _BUFFERS:
        getattr(program, _BUFFERS[name])[:count, column] = getattr(state, name)


def store_every_position(state: TokenState, program: RoundState, count: int) -> None:
    """Write an every-position `state` ([count * (K + 1)], row-major) back."""
    width = program.width
    for name in _BUFFERS:
        value = getattr(state, name)
        target = getattr(program, _BUFFERS[name])[:count]
        target.copy_(value.view(count, width, *value.shape[1:]))


def load_column(program: RoundState, count: int, column: int) -> TokenState:
    """Column `column` of slots [0, count), copied (the fused kernels update in place)."""
    return _load(program, lambda buffer: buffer[:count, column].clone(), column, count)


def load_every_position(program: RoundState, count: int) -> TokenState:
    """Every position of slots [0, count), row-major."""
    return _load(program, lambda buffer: buffer[:count].flatten(0, 1), None, count)


def _load(program: RoundState, take, column: int | None, count: int) -> TokenState:
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
    return TokenState(position=position, output_index=output, **values)


# TokenState field -> RoundState position buffer
_BUFFERS = {
    "hidden": "hidden",
    "loops": "loops",
    "survival": "survival",
    "pending": "pending",
    "exited": "exited",
    "depth": "depths",
}
