"""Device evaluation of the scheduler's exit rules (rlt_contracts.ExitRule), one loop at a time.

The scheduler decides the policy; this code only applies each row's rule to the loop that just
ran, with whole-batch tensor ops (no host reads, capturable in a CUDA graph). Rows of different
rule kinds mix in one batch. The hazard product is kept in fp64 from the fp32 gate, exactly as a
host would compute it in Python floats.

`apply_exit_rules` works on any batch of tokens: the decode tick's rows (`decide_exits`) or a
speculative round's positions, each with its own exit state and output index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_runner.row_state import (
    DELAYED_CODE,
    DELAYED_KL_CODE,
    DELAYED_LATENT_CODE,
    HAZARD_CODE,
    KL_CODE,
    LATENT_CODE,
    DecodeRows,
)


@dataclass(frozen=True)
class ExitDecision:
    """exits [B] bool: the token stops looping after `loop_index`; survival [B] fp64 and
    pending_exit [B] int64: the rows' exit state after this loop (for rows that continue)."""

    exits: torch.Tensor
    survival: torch.Tensor
    pending_exit: torch.Tensor


@dataclass(frozen=True)
class ExitRules:
    """The decode rules of a batch of tokens, one entry per token: kind (row_state's codes),
    min_loops, max_loops [B] int64, threshold [B] fp64, trace [B, capacity] int8."""

    kind: torch.Tensor
    min_loops: torch.Tensor
    max_loops: torch.Tensor
    threshold: torch.Tensor
    trace: torch.Tensor

    @classmethod
    def of_rows(cls, rows: DecodeRows, index: slice | torch.Tensor) -> ExitRules:
        """The rules of rows `index` (views for a slice, gathered copies for a tensor)."""
        return cls(
            rows.rule_kind[index],
            rows.min_loops[index],
            rows.max_loops[index],
            rows.threshold[index],
            rows.trace[index],
        )

    def repeat(self, times: int) -> ExitRules:
        """Each entry repeated `times` times in place (one per position of a row)."""
        return ExitRules(*(t.repeat_interleave(times, dim=0) for t in vars(self).values()))


def decide_exits(
    rows: DecodeRows, num_rows: int, loop_index: torch.Tensor, gate: torch.Tensor | None
) -> ExitDecision:
    """Apply rows [0, num_rows)'s rules after loop `loop_index` [B] (1-based) with gate
    probabilities `gate` [B] fp32 (None when no row's rule reads the gate)."""
    B = num_rows
    return apply_exit_rules(
        ExitRules.of_rows(rows, slice(0, B)),
        loop_index,
        gate,
        survival=rows.survival[:B],
        pending_exit=rows.pending_exit[:B],
        output_index=rows.outputs[:B],
    )


def apply_exit_rules(
    rules: ExitRules,
    loop_index: torch.Tensor,
    signal: torch.Tensor | None,
    *,
    survival: torch.Tensor,
    pending_exit: torch.Tensor,
    output_index: torch.Tensor,
) -> ExitDecision:
    """Apply each token's rule after loop `loop_index` [B] (1-based), given its exit state
    before the loop (survival fp64, pending_exit) and the output index it will produce (the
    TRACE rule's entry). `signal` [B] fp32 is the loop's exit signal: the gate's exit
    probability for the hazard rules, the latent change for the latent rules (one family per
    engine, so one kind of signal per batch)."""
    at_max = loop_index >= rules.max_loops
    pending = pending_exit
    converging = (  # rules that exit when their signal falls below the threshold
        (rules.kind == LATENT_CODE)
        | (rules.kind == DELAYED_LATENT_CODE)
        | (rules.kind == KL_CODE)
        | (rules.kind == DELAYED_KL_CODE)
    )
    if signal is not None:
        value = signal.to(torch.float64)
        survival = torch.where(converging, survival, survival * (1.0 - value))
        crossed = torch.where(
            converging, value < rules.threshold, 1.0 - survival >= rules.threshold
        )
        triggered = (rules.threshold < 1.0) & (loop_index >= rules.min_loops) & crossed
        at_once = at_max | triggered
        delayed_exit = at_max | ((pending > 0) & (loop_index >= pending))
        pending = torch.where((pending == 0) & triggered, loop_index + 1, pending)
    else:
        at_once = at_max
        delayed_exit = at_max | ((pending > 0) & (loop_index >= pending))
    trace_index = output_index.clamp(max=rules.trace.shape[1] - 1)
    trace_depth = rules.trace.gather(1, trace_index[:, None]).squeeze(1).to(torch.int64)
    immediate = (rules.kind == HAZARD_CODE) | (rules.kind == LATENT_CODE) | (rules.kind == KL_CODE)
    delayed = (
        (rules.kind == DELAYED_CODE)
        | (rules.kind == DELAYED_LATENT_CODE)
        | (rules.kind == DELAYED_KL_CODE)
    )
    exits = torch.where(
        immediate, at_once, torch.where(delayed, delayed_exit, loop_index >= trace_depth)
    )
    return ExitDecision(exits, survival, pending)
