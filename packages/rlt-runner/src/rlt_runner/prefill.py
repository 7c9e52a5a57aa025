"""Prompt chunks at full depth (eager, or as CUDA graphs: prefill_graphs.py, shared_prefill.py).

Metadata is built once per call from one upload of host lists, then derived on the device for
every plane (no per-loop uploads, no host reads):

- LAST_EXITED, depth-major: every chunk position runs loop 1 (plane 0), then loop 2, and so on
  up to its request's `max_loops` (the prompt's depth); a position at loop t reads plane t of
  earlier positions. A prompt run at e < T loops writes nothing past loop e, then its plane
  e - 1 KV is copied into the deeper planes (as an exited token's). A prefix-LM
  family's prompt (`PromptMask.PREFIX_LM`) comes as one whole chunk and is one bidirectional
  block: every position reads every prompt position at each loop (`PagedAttentionBatch.causal`).
- A family with stage layers (`KVPlan.stage_layers`, stage_plane.py) runs its prelude on the
  chunk before loop 1 and its coda after the last loop, both over the stage plane; the kept
  states are then the coda's output (the head's input).
- A family whose KV is one plane that every loop overwrites (`KVPlan.per_loop` False) runs
  depth-major on that plane: loop k of the prompt sees the past's final keys and the prompt's
  own loop-k keys (its prompts come whole).
- RING ("ring:K"), depth-major the same way: loop t runs at plane (t - 1) mod K, so every
  chunk position at loop t reads the chunk's loop-t keys and the earlier chunks' latest loop of
  that plane; a prompt run at e < K loops gets its plane e - 1 KV copied into planes e..K-1
  (planes it never wrote). With K below the loop cap the engine sends prompts whole (the KV
  depends on the chunking otherwise; `KVLayoutSpec.folds_loops`).
- SHARED, position by position: each request advances one prompt position at a time through all
  loops (batched across requests), so every prompt token sees earlier prompt tokens at their
  final depth whatever the chunk boundaries are (slow: the layout's semantics require it). With
  CUDA graphs each position is one graph replay (shared_prefill.py), else eager calls.

A chunk that completes its prompt leaves the state of its last position in the row's `hidden`.
`keep_states` names chunks whose every position's final state is returned (prompt scoring:
those steps run eagerly).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import torch
from rlt_contracts import (
    AttentionBackend,
    KVLayout,
    KVLayoutSpec,
    LoopedLanguageModel,
    PagedAttentionBatch,
    PromptMask,
)

from rlt_runner.kv_storage import KVStorage
from rlt_runner.prefill_graphs import PrefillGraphs
from rlt_runner.row_state import DecodeRows
from rlt_runner.shared_prefill import SharedPrefillGraphs
from rlt_runner.transfers import upload


class PrefillGroups:
    """Packed query rows of several groups (runs of consecutive positions of one request each),
    with everything a model call needs except the plane's block tables."""

    def __init__(
        self,
        rows: DecodeRows,
        row_ids: list[int],
        starts: list[int],
        lengths: list[int],
        token_ids: list[int],
        *,
        block_size: int,
    ) -> None:
        ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        query_start = [0, *accumulate(lengths)]
        positions = [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
        group_of_query = [g for g, n in enumerate(lengths) for _ in range(n)]
        ints = upload(
            [token_ids, positions, group_of_query], torch.int64, rows.device
        )  # one upload for the per-query columns
        meta = upload([row_ids, ends, query_start[1:]], torch.int64, rows.device)
        self.rows = rows
        self.block_size = block_size
        self.token_ids, self.positions, self.group_of_query = ints.unbind(0)
        self.row_index = meta[0]
        self.context_lengths = meta[1].to(torch.int32)
        self.query_start = torch.cat([meta[2].new_zeros(1), meta[2]]).to(torch.int32)
        self.max_query_len = max(lengths)
        self.max_context_len = max(ends)
        self.pages = (self.max_context_len - 1) // block_size + 1
        self.last_query = meta[2] - 1  # [S] packed index of each group's last query

    @classmethod
    def of_chunks(cls, rows: DecodeRows, chunks, *, block_size: int) -> PrefillGroups:
        """One group per chunk (row, start_position, token_ids, completes_prompt)."""
        return cls(
            rows,
            [row for row, _, _, _ in chunks],
            [start for _, start, _, _ in chunks],
            [len(tokens) for _, _, tokens, _ in chunks],
            [t for _, _, tokens, _ in chunks for t in tokens],
            block_size=block_size,
        )

    def batch(self, plane: int, *, causal: bool = True) -> PagedAttentionBatch:
        tables = self.rows.block_tables[self.row_index, plane, : self.pages]
        blocks = tables[self.group_of_query, self.positions // self.block_size].to(torch.int64)
        return PagedAttentionBatch(
            query_start=self.query_start,
            context_lengths=self.context_lengths,
            block_tables=tables,
            write_slots=blocks * self.block_size + self.positions % self.block_size,
            max_query_len=self.max_query_len,
            max_context_len=self.max_context_len,
            causal=causal,
        )


def run_prefill(
    model: LoopedLanguageModel,
    attention: AttentionBackend,
    kv: KVStorage,
    rows: DecodeRows,
    layout: KVLayoutSpec,
    chunks: list[tuple[int, int, tuple[int, ...], bool]],
    *,
    graphs: PrefillGraphs | None = None,
    shared_waves: SharedPrefillGraphs | None = None,
    keep_states: frozenset[int] = frozenset(),
    loops: list[int] | None = None,
    state_uniforms=None,
) -> dict[int, torch.Tensor]:
    """Run chunks (row, start_position, token_ids, completes_prompt), each at its request's
    `loops` (None: every chunk at the model's depth); with CUDA graphs on, `graphs`
    (depth-major steps) or `shared_waves` (the SHARED layout's waves) run chunks at full depth.
    `state_uniforms`: the source of a family's random initial state
    (`TokenSampler.state_uniforms`; None: the zero state).
    Returns {chunk index: final states [len, d]} for the chunks in `keep_states` (eager)."""
    if not chunks:
        return {}
    depth = model.shape.num_loops
    if loops is not None and all(n == depth for n in loops):
        loops = None
    if keep_states or loops is not None:
        graphs = shared_waves = None
    loops = loops or [depth] * len(chunks)
    position_major = layout.kind is KVLayout.SHARED and model.family.kv.per_loop
    if position_major and shared_waves is not None:
        shared_waves.run(chunks)
    elif position_major:
        return _position_by_position(model, attention, kv, rows, chunks, keep_states, loops)
    elif graphs is None or not graphs.run(chunks):
        return _depth_major(
            model, attention, kv, rows, layout, chunks, keep_states, loops, state_uniforms
        )
    return {}


def _depth_major(
    model, attention, kv, rows, layout, chunks, keep_states, loops, state_uniforms=None
) -> dict:
    groups = PrefillGroups.of_chunks(rows, chunks, block_size=kv.block_size)
    causal = model.family.prompt_mask is not PromptMask.PREFIX_LM  # prompts come whole then
    stage = rows.stage_plane  # the prelude's and coda's KV (stage_plane.py)
    if stage is None:
        hidden = model.embed(groups.token_ids)
    else:
        stage_attention = attention.bind(kv.tensors, groups.batch(stage, causal=causal))
        extra = {}
        if state_uniforms is not None:  # each query's request seed and position
            seeds = rows.seed[groups.row_index][groups.group_of_query]
            width = model.shape.hidden_size
            extra["uniforms"] = state_uniforms(seeds, groups.positions, width)
        hidden = model.embed(groups.token_ids, groups.positions, stage_attention, **extra)
    depth = model.shape.num_loops
    query_loops = None  # [N] loops of each query's request, when some run fewer than `depth`
    if min(loops) < depth:
        per_query = [n for n, (_, _, tokens, _) in zip(loops, chunks, strict=True) for _ in tokens]
        query_loops = upload(per_query, torch.int64, rows.device)
    for loop in range(1, max(loops) + 1):
        batch = groups.batch(layout.plane_of_loop(loop), causal=causal)
        done = None if query_loops is None else query_loops < loop
        hidden = _loop(model, attention, kv, hidden, groups.positions, batch, done)
    if query_loops is not None and layout.fills_unreached_planes and rows.loop_planes > 1:
        _copy_into_deeper_planes(kv, groups, query_loops, rows.loop_planes)
    if stage is not None:  # every position's coda KV; the states the head reads
        hidden = model.finish(hidden, groups.positions, stage_attention)
    _keep_final_states(rows, groups, hidden, [done for _, _, _, done in chunks])
    states = hidden.split([len(tokens) for _, _, tokens, _ in chunks])
    return {i: states[i] for i in keep_states}


def _loop(model, attention, kv, hidden, positions, batch, done) -> torch.Tensor:
    """One loop of every query; the queries `done` (past their request's loops; None: none)
    write nothing and keep their state."""
    if done is not None:
        batch = replace(batch, write_slots=torch.where(done, kv.scratch_slot, batch.write_slots))
    computed, _ = model.recurrent_step(
        hidden, positions, attention.bind(kv.tensors, batch), compute_gate=False
    )
    return computed if done is None else torch.where(done[:, None], hidden, computed)


def _copy_into_deeper_planes(kv, groups: PrefillGroups, query_loops, planes: int) -> None:
    """LAST_EXITED (`planes` = T) and RING (`planes` = K): a prompt run at e < planes loops gets
    its plane e - 1 KV copied into planes e..planes-1, as an exited token's (later queries at a
    deeper loop read its last version, never a plane it did not write). A prompt run at
    e >= planes loops (a ring's) wrote every plane: nothing is copied."""
    slots = torch.stack([groups.batch(plane).write_slots for plane in range(planes)])  # [P, N]
    last_plane = torch.clamp(query_loops - 1, max=planes - 1)
    last = slots.gather(0, last_plane[None, :]).squeeze(0)
    sources, targets = [], []
    for plane in range(1, planes):
        deeper = query_loops <= plane
        sources.append(torch.where(deeper, last, kv.scratch_slot))
        targets.append(torch.where(deeper, slots[plane], kv.scratch_slot))
    kv.copy_slots(torch.cat(sources), torch.cat(targets))


def _position_by_position(model, attention, kv, rows, chunks, keep_states, loops) -> dict:
    if rows.stage_plane is not None:
        raise ValueError("position-by-position prompts do not run a family's stage layers")
    kept: dict[int, list[torch.Tensor]] = {i: [] for i in keep_states}
    for offset in range(max(len(tokens) for _, _, tokens, _ in chunks)):
        wave = [c for c in chunks if offset < len(c[2])]
        groups = PrefillGroups(
            rows,
            [row for row, _, _, _ in wave],
            [start + offset for _, start, _, _ in wave],
            [1] * len(wave),
            [tokens[offset] for _, _, tokens, _ in wave],
            block_size=kv.block_size,
        )
        hidden = model.embed(groups.token_ids)
        wave_loops = [n for n, c in zip(loops, chunks, strict=True) if offset < len(c[2])]
        mixed = min(wave_loops) < max(wave_loops)
        stops = upload(wave_loops, torch.int64, rows.device) if mixed else None
        for loop in range(1, max(wave_loops) + 1):
            done = None if stops is None else stops < loop
            hidden = _loop(model, attention, kv, hidden, groups.positions, groups.batch(0), done)
        last = [done and offset == len(tokens) - 1 for _, _, tokens, done in wave]
        _keep_final_states(rows, groups, hidden, last)
        in_wave = [i for i, c in enumerate(chunks) if offset < len(c[2])]
        for j, i in enumerate(in_wave):
            if i in kept:
                kept[i].append(hidden[j])
    return {i: torch.stack(states) for i, states in kept.items()}


def _keep_final_states(rows: DecodeRows, groups: PrefillGroups, hidden, keep: list[bool]) -> None:
    """Store the last query's state of every group flagged in `keep` into its row's hidden."""
    kept = [g for g, flag in enumerate(keep) if flag]
    if not kept:
        return
    group_index = upload(kept, torch.int64, rows.device)
    rows.hidden.index_copy_(
        0, groups.row_index[group_index], hidden[groups.last_query[group_index]]
    )
