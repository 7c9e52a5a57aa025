"""A step's prompt chunks: at full depth (prefill.py), or for prompts scored at each position's
exit depth (`score_at_exit_depth`) as decoding would run them (exit_depth_prefill.py); then every
scored chunk's states through the LM head (prompt_scoring.py). The two kinds belong to different
requests, each writing only its own blocks and reading only pages completed in earlier steps (a
prefix-cache hit of an exit-depth prompt is a page published under its exit rule's salt), so
their order does not matter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rlt_contracts import AttentionBackend, KVLayoutSpec, LoopedLanguageModel, PrefillChunk

from rlt_runner.exit_depth_prefill import run_at_exit_depth
from rlt_runner.kv_storage import KVStorage
from rlt_runner.position_loops import PositionLoops
from rlt_runner.prefill import run_prefill
from rlt_runner.prefill_graphs import PrefillGraphs
from rlt_runner.prompt_scoring import score_chunk
from rlt_runner.row_record import RowRecord
from rlt_runner.row_state import DecodeRows
from rlt_runner.shared_prefill import SharedPrefillGraphs
from rlt_runner.transfers import upload


@dataclass
class ChunkResults:
    """scores: (record, first scored token, packed rows on their way to the host) per scored
    chunk; last_exit_depths: {row: exit depth, a device scalar} of the prompts run at exit
    depth that these chunks complete (token 0's depth)."""

    scores: list[tuple[RowRecord, int, torch.Tensor]] = field(default_factory=list)
    last_exit_depths: dict[int, torch.Tensor] = field(default_factory=dict)


def run_prompt_chunks(
    model: LoopedLanguageModel,
    attention: AttentionBackend,
    kv: KVStorage,
    rows: DecodeRows,
    layout: KVLayoutSpec,
    position_loops: PositionLoops,
    chunks: list[PrefillChunk],
    *,
    graphs: PrefillGraphs | None,
    shared_waves: SharedPrefillGraphs | None,
    state_uniforms=None,
) -> ChunkResults:
    records = [rows.record(c.identity) for c in chunks]
    at_exit = [i for i, r in enumerate(records) if r.sampling.score_at_exit_depth]
    full = [i for i, r in enumerate(records) if not r.sampling.score_at_exit_depth]

    def described(indices: list[int]) -> list[tuple[int, int, tuple[int, ...], bool]]:
        return [
            (records[i].row, chunks[i].start_position, chunks[i].token_ids,
             chunks[i].completes_prompt)
            for i in indices
        ]  # fmt: skip

    kept = run_prefill(
        model,
        attention,
        kv,
        rows,
        layout,
        described(full),
        graphs=graphs,
        shared_waves=shared_waves,
        keep_states=frozenset(
            j for j, i in enumerate(full) if records[i].sampling.prompt_logprobs is not None
        ),
        loops=[records[i].rule.exit.max_loops for i in full],
        state_uniforms=state_uniforms,
    )
    states_of = {full[j]: (states, None) for j, states in kept.items()}
    results = ChunkResults()
    if at_exit:
        gate = any(records[i].rule.exit.uses_gate for i in at_exit)
        ran = run_at_exit_depth(position_loops, layout, described(at_exit), gate=gate)
        for i, result in zip(at_exit, ran, strict=True):
            states_of[i] = (result.states, result.depths)
            if chunks[i].completes_prompt:
                results.last_exit_depths[records[i].row] = result.depths[-1]
    for i in sorted(states_of):
        states, depths = states_of[i]
        score = score_chunk(model, states, records[i], chunks[i].start_position, exit_depths=depths)
        if score is not None:
            results.scores.append((records[i], *score))
    return results


def token0_depths(
    started: list[RowRecord],
    last_exit_depths: dict[int, torch.Tensor],
    *,
    full_depth: int,
    device: torch.device,
) -> torch.Tensor | None:
    """[n] int64 loops of the started rows' token 0: their request's max_loops (the depth their
    prompt ran at), except for prompts run at exit depth (their last position's); None when
    all are at `full_depth`."""
    at = [j for j, r in enumerate(started) if r.row in last_exit_depths]
    loops = [r.rule.exit.max_loops for r in started]
    if not at and all(n == full_depth for n in loops):
        return None
    depths = upload(loops, torch.int64, device)
    if not at:
        return depths
    depths.index_copy_(
        0,
        upload(at, torch.int64, device),
        torch.stack([last_exit_depths[started[j].row] for j in at]),
    )
    return depths
