"""The device evaluation of exit rules equals the scheduler's policy semantics, loop by loop,
for every rule kind, with rows of different kinds and depths in one batch (CPU tensors)."""

from __future__ import annotations

import torch
from rlt_contracts import DecodeRule, ExecutionIdentity, ExitRule, ExitRuleKind, SamplingParams
from rlt_runner import DecodeRows, RowRecord
from rlt_runner.exit_rules import decide_exits


def make_rows(*rules: ExitRule) -> DecodeRows:
    table = DecodeRows(
        max_rows=len(rules),
        num_planes=1,
        max_pages=4,
        hidden_size=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        scratch_block=9,
        trace_capacity=8,
    )
    table.assign(
        [
            RowRecord(ExecutionIdentity(f"r{i}", i), -1, SamplingParams(), DecodeRule(rule, 8), 1)
            for i, rule in enumerate(rules)
        ]
    )
    return table


def exit_depths(table: DecodeRows, gates: list[list[float]], tokens: int) -> list[list[int]]:
    """Run the rule loop by loop (the decode tick's bookkeeping) and list each row's depths;
    gates[row][loop - 1] is the gate probability after that loop."""
    rows = table.hidden.shape[0]
    depths: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(tokens * 4):
        loop_index = table.loops + 1
        gate = torch.tensor(
            [g[min(int(k), len(g)) - 1] for g, k in zip(gates, loop_index, strict=True)]
        )
        decision = decide_exits(table, rows, loop_index, gate.float())
        for row in range(rows):
            if decision.exits[row] and len(depths[row]) < tokens:
                depths[row].append(int(loop_index[row]))
        exits = decision.exits
        table.loops = torch.where(exits, 0, loop_index)
        table.survival = torch.where(exits, 1.0, decision.survival)
        table.pending_exit = torch.where(exits, 0, decision.pending_exit)
        table.outputs = table.outputs + exits.long()
    return depths


def test_hazard_accumulates_and_exits_when_the_cdf_reaches_the_threshold():
    """Gate 0.4 every loop, threshold 0.6: CDF 0.4 after loop 1, 0.64 after loop 2 -> exit at
    2, though 0.4 alone never reaches 0.6. min_loops still accumulates; threshold 1.0 is fixed
    depth even when the gate says 1."""
    table = make_rows(
        ExitRule(ExitRuleKind.HAZARD, 1, 4, 0.6),
        ExitRule(ExitRuleKind.HAZARD, 3, 4, 0.5),
        ExitRule(ExitRuleKind.HAZARD, 1, 4, 1.0),
        ExitRule(ExitRuleKind.HAZARD, 1, 3, 0.99),
    )
    gates = [[0.4] * 4, [0.999] * 4, [1.0] * 4, [0.1] * 4]
    assert exit_depths(table, gates, 3) == [[2] * 3, [3] * 3, [4] * 3, [3] * 3]


def test_hazard_product_is_kept_in_fp64_like_host_floats():
    table = make_rows(ExitRule(ExitRuleKind.HAZARD, 1, 4, 0.5))
    loop_index = torch.tensor([1])
    gate = torch.tensor([0.3], dtype=torch.float32)
    decision = decide_exits(table, 1, loop_index, gate)
    assert decision.survival.dtype == torch.float64
    assert decision.survival.item() == 1.0 * (1.0 - float(gate.item()))


def test_delayed_hazard_exits_one_loop_after_the_trigger_and_max_loops_wins():
    table = make_rows(
        ExitRule(ExitRuleKind.DELAYED_HAZARD, 1, 4, 0.5),
        ExitRule(ExitRuleKind.DELAYED_HAZARD, 2, 4, 0.5),
        ExitRule(ExitRuleKind.DELAYED_HAZARD, 1, 2, 0.5),
        ExitRule(ExitRuleKind.HAZARD, 1, 4, 0.5),
    )
    gates = [[0.6] * 4, [0.6] * 4, [0.0, 0.9, 0.0, 0.0], [0.6] * 4]
    assert exit_depths(table, gates, 2) == [[2, 2], [3, 3], [2, 2], [1, 1]]


def test_trace_replays_depths_by_output_index_without_a_gate():
    trace = ExitRule(ExitRuleKind.TRACE, 1, 4, trace_depths=(4, 3, 1, 2, 4))
    table = make_rows(trace, ExitRule(ExitRuleKind.HAZARD, 2, 2, 1.0))
    table.outputs.fill_(1)  # token 0 came from prefill
    loops_seen = []
    for _ in range(12):
        loop_index = table.loops + 1
        decision = decide_exits(table, 2, loop_index, None)
        if decision.exits[0] and len(loops_seen) < 4:
            loops_seen.append(int(loop_index[0]))
        assert not decision.exits[1] or int(loop_index[1]) == 2
        table.loops = torch.where(decision.exits, 0, loop_index)
        table.outputs = table.outputs + decision.exits.long()
    assert loops_seen == [3, 1, 2, 4]
