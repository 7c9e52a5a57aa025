"""Device evaluation of the scheduler's exit rules (rlt_contracts.ExitRule), one loop at a time.

The scheduler decides the policy; this code only applies each row's rule to the loop that just
ran, with whole-batch tensor ops (no host reads, capturable in a CUDA graph). Rows of different
rule kinds mix in one batch. The hazard product is kept in fp64 from the fp32 gate, exactly as a
host would compute it in Python floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_runner.row_state import DELAYED_CODE, HAZARD_CODE, DecodeRows


@dataclass(frozen=True)
class ExitDecision:
    """exits [B] bool: the token stops looping after `loop_index`; survival [B] fp64 and
    pending_exit [B] int64: the rows' exit state after this loop (for rows that continue)."""

    exits: torch.Tensor
    survival: torch.Tensor
    pending_exit: torch.Tensor


def decide_exits(
    rows: DecodeRows, num_rows: int, loop_index: torch.Tensor, gate: torch.Tensor | None
) -> ExitDecision:
    """Apply rows [0, num_rows)'s rules after loop `loop_index` [B] (1-based) with gate
    probabilities `gate` [B] fp32 (None when no row's rule reads the gate)."""
    B = num_rows
    at_max = loop_index >= rows.max_loops[:B]
    survival = rows.survival[:B]
    pending = rows.pending_exit[:B]
    if gate is not None:
        survival = survival * (1.0 - gate.to(torch.float64))
        threshold = rows.threshold[:B]
        triggered = (
            (threshold < 1.0) & (loop_index >= rows.min_loops[:B]) & (1.0 - survival >= threshold)
        )
        hazard_exit = at_max | triggered
        delayed_exit = at_max | ((pending > 0) & (loop_index >= pending))
        pending = torch.where((pending == 0) & triggered, loop_index + 1, pending)
    else:
        hazard_exit = at_max
        delayed_exit = at_max | ((pending > 0) & (loop_index >= pending))
    output_index = rows.outputs[:B].clamp(max=rows.trace_capacity - 1)
    trace_depth = rows.trace[:B].gather(1, output_index[:, None]).squeeze(1).to(torch.int64)
    kind = rows.rule_kind[:B]
    exits = torch.where(
        kind == HAZARD_CODE,
        hazard_exit,
        torch.where(kind == DELAYED_CODE, delayed_exit, loop_index >= trace_depth),
    )
    return ExitDecision(exits, survival, pending)
