"""Prompt chunks run as decoding would run them (`SamplingParams.score_at_exit_depth`).

Every prompt position loops under its request's exit rule and stops where it fires, its exit
state then scoring the next prompt token; README.md, "Prompt chunks at exit depth", says why the
`PositionLoops` passes equal decoding and works an example. Earlier chunks of the same prompt
ran the same way, and so did the pages of a prefix-cache hit (published under the same exit
rule's salt), so chunking and reuse change nothing. Each position's TRACE entry is its position
(the output index a decode fed the prompt from position 0 would give it). Eager only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import KVLayout, KVLayoutSpec

from rlt_runner.exit_rules import ExitRules
from rlt_runner.loop_bookkeeping import kv_slots_of
from rlt_runner.position_loops import PositionLoops
from rlt_runner.prefill import PrefillGroups
from rlt_runner.token_state import TokenState
from rlt_runner.transfers import upload


@dataclass(frozen=True)
class ExitDepthStates:
    """One chunk's positions after the pass: exit states [len, d] and exit depths [len] int64
    (loops run, 1..T), on the device."""

    states: torch.Tensor
    depths: torch.Tensor


def run_at_exit_depth(
    loops: PositionLoops,
    layout: KVLayoutSpec,
    chunks: list[tuple[int, int, tuple[int, ...], bool]],
    *,
    gate: bool,
) -> list[ExitDepthStates]:
    """Run chunks (row, start_position, token_ids, completes_prompt) under their rows' exit
    rules (`gate`: some rule reads the exit gate). A chunk that completes its prompt leaves its
    last position's exit state in the row's `hidden` (token 0 is sampled from it)."""
    if layout.kind is KVLayout.RING:  # the engine refuses such requests at admission
        raise ValueError(f"exit-depth scoring reads last_exited or shared KV, not {layout}")
    if layout.kind is KVLayout.LAST_EXITED:
        results = _depth_major(loops, chunks, gate)
    else:
        results = _position_by_position(loops, chunks, gate)
    done = [i for i, (_, _, _, completes) in enumerate(chunks) if completes]
    if done:
        rows = loops.rows
        index = upload([chunks[i][0] for i in done], torch.int64, rows.device)
        rows.hidden.index_copy_(0, index, torch.stack([results[i].states[-1] for i in done]))
    return results


def _depth_major(loops: PositionLoops, chunks, gate: bool) -> list[ExitDepthStates]:
    rows, block_size = loops.rows, loops.kv.block_size
    groups = PrefillGroups.of_chunks(rows, chunks, block_size=block_size)
    tables = rows.block_tables[groups.row_index, :, : groups.pages]  # [G, planes, pages]
    state = TokenState.fresh(
        loops.model.embed(groups.token_ids), groups.positions, groups.positions
    )
    state.kv_slots = kv_slots_of(tables[groups.group_of_query], groups.positions, block_size)
    loops.depth_major(
        state,
        ExitRules.of_rows(rows, groups.row_index[groups.group_of_query]),
        torch.ones_like(groups.positions, dtype=torch.bool),
        group_tables=tables,
        query_start=groups.query_start,
        context_lengths=groups.context_lengths,
        max_query_len=groups.max_query_len,
        loops=range(1, loops.depth + 1),
        gate=gate,
        max_context=groups.max_context_len,
    )
    sizes = [len(tokens) for _, _, tokens, _ in chunks]
    return list(map(ExitDepthStates, state.hidden.split(sizes), state.depth.split(sizes)))


def _position_by_position(loops: PositionLoops, chunks, gate: bool) -> list[ExitDepthStates]:
    rows = loops.rows
    states: list[list[torch.Tensor]] = [[] for _ in chunks]
    depths: list[list[torch.Tensor]] = [[] for _ in chunks]
    for offset in range(max(len(tokens) for _, _, tokens, _ in chunks)):
        wave = [i for i, (_, _, tokens, _) in enumerate(chunks) if offset < len(tokens)]
        row_index, positions, token_ids = upload(
            [
                [chunks[i][0] for i in wave],
                [chunks[i][1] + offset for i in wave],
                [chunks[i][2][offset] for i in wave],
            ],
            torch.int64,
            rows.device,
        ).unbind(0)
        tables = rows.block_tables[row_index]  # [n, 1, pages]
        state = TokenState.fresh(loops.model.embed(token_ids), positions, positions)
        state.kv_slots = loops.bookkeeping.position_slots(tables, positions)
        loops.one_position(
            state,
            ExitRules.of_rows(rows, row_index),
            torch.ones_like(positions, dtype=torch.bool),
            tables=tables,
            loop_cap=loops.depth,
            iterations=loops.depth,
            gate=gate,
            max_context=max(chunks[i][1] + offset for i in wave) + 1,
        )
        for j, i in enumerate(wave):
            states[i].append(state.hidden[j])
            depths[i].append(state.depth[j])
    return [
        ExitDepthStates(torch.stack(s), torch.stack(d)) for s, d in zip(states, depths, strict=True)
    ]
