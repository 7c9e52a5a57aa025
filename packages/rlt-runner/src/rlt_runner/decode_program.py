"""`DecodeProgram`: one decode tick for rows [0, B), entirely on the device.

README.md, "Worked example 1", walks through a tick: one loop at each row's plane, the exit
rule, the LAST_EXITED finalization copies, the coda and sampler for every row (a fixed shape, so
the tick is one CUDA graph; with the Triton tick kernels the head is told whether any row exits),
and the commit. Nothing is read back, so K ticks queue back to back; rows that are not active
compute garbage that is never kept (scratch-slot writes, one key read, masked updates).

A family with stage layers (Dory, Huginn: `KVPlan.stage_layers`, stage_plane.py) also runs, in
the same tick, its prelude for the rows whose token starts (before the loop) and its coda's
layers for the rows that exit (before the head), both on the stage plane; its next token's
state is then made by that prelude in the token's first tick, not at commit.

`start_rows` is the coda of rows whose prompt just completed (token 0, full depth).

Ring layout: float64 [max_ticks + WARMUP_RUNS, S, 3 + 2k]; columns token (-1 = no token this
tick), exit depth, then with logprobs: the token's logprob, k alternative ids, k alternative
logprobs. Token ids (< 2**53) and fp32 logprobs are exact in fp64. The last WARMUP_RUNS rows
(from `spare_tick`) are never read back: a graph capture's eager warm-up ticks record there
(decode_graphs.py), whatever tick of a step it happens in, and leave the step's rows intact.
"""

from __future__ import annotations

import math

import torch
from rlt_contracts import (
    AttentionBackend,
    ExitSignal,
    KVLayoutSpec,
    LoopedLanguageModel,
    PagedAttentionBatch,
    SampledRows,
    SamplingMode,
    TokenSampler,
)
from rlt_contracts.sampling import MAX_TOP_LOGPROBS

from rlt_runner import tick_kernels
from rlt_runner.exit_rules import decide_exits
from rlt_runner.graph_capture import WARMUP_RUNS
from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_state import DecodeRows
from rlt_runner.stage_plane import StagePlane

RING_COLUMNS = 3 + 2 * MAX_TOP_LOGPROBS


def record_columns(mode: SamplingMode) -> int:
    """Ring columns a step in `mode` fills (token and depth; logprob fields when asked)."""
    return 2 if mode.top_logprobs is None else 3 + 2 * mode.top_logprobs


class DecodeProgram:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        sampler: TokenSampler,
        kv: KVStorage,
        rows: DecodeRows,
        *,
        layout: KVLayoutSpec,
        cohort: bool,
        max_ticks: int,
        random_initial_state: bool = True,
        distribution_exits: bool = False,
    ) -> None:
        """`random_initial_state`: a family declaring a random initial state draws it from
        each token's (seed, position) stream (False: the zero state). `distribution_exits`:
        the engine's exit rules read the next-token distribution after every loop (the KL
        rules): every running row then runs the coda and head each tick."""
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.kv = kv
        self.rows = rows
        self.layout = layout
        self.cohort = cohort
        self.depth = model.shape.num_loops
        self.block_size = kv.block_size
        device = rows.device
        num_rows = rows.hidden.shape[0]
        self.query_start = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
        self.tick_index = torch.zeros(1, dtype=torch.int64, device=device)
        self.spare_tick = max_ticks  # first ring row of the capture warm-ups (module doc)
        self.ring = torch.zeros(
            max_ticks + WARMUP_RUNS, num_rows, RING_COLUMNS, dtype=torch.float64, device=device
        )
        self.stage = (
            StagePlane(kv, rows, self.query_start) if rows.stage_plane is not None else None
        )
        # the uniforms a family's random initial state is drawn from (None: zero state)
        self.state_uniforms = (
            sampler.state_uniforms
            if random_initial_state and model.family.random_initial_state
            else None
        )
        self.distribution_exits = distribution_exits
        # the fused bookkeeping runs no stage layers and the hazard and trace rules only (not the
        # latent-change or KL rules)
        fused_tick = (
            device.type == "cuda"
            and tick_kernels.available()
            and self.stage is None
            and model.family.exit_signal is not ExitSignal.LATENT_CHANGE
            and not distribution_exits
        )
        self.kernels = tick_kernels.TickKernels(self) if fused_tick else None

    def begin_step(self) -> None:
        """The next tick records into ring row 0."""
        self.tick_index.zero_()

    # -- one tick ------------------------------------------------------------------------------
    def tick(
        self, num_rows: int, mode: SamplingMode, gate: bool, max_context: int | None = None
    ) -> None:
        """Run one tick for rows [0, num_rows). `gate`: some row's rule reads the exit gate
        (else it is not computed). max_context (host int) bounds the keys any row can see
        (None: the full table width, as graphs need)."""
        if self.kernels is not None:
            self._fused_tick(num_rows, mode, gate, max_context)
            return
        B, rows = num_rows, self.rows
        if self.cohort:  # parked rows start together once no row is looping (held rows,
            # structured output's awaiting their next mask, do not loop either)
            looping = rows.active[:B] & ~rows.parked[:B] & ~rows.held[:B]
            rows.parked[:B] &= looping.any()
        run = rows.active[:B] & ~rows.parked[:B] & ~rows.held[:B]
        loop_index = rows.loops[:B] + 1
        position = rows.position[:B]
        plane = torch.clamp(self.layout.plane_of_loop(loop_index), max=rows.loop_planes - 1)
        pages = rows.block_tables.shape[-1]
        tables = rows.block_tables[:B].gather(1, plane.view(B, 1, 1).expand(B, 1, pages)).squeeze(1)
        page = torch.clamp(position // self.block_size, max=pages - 1)
        offset = position % self.block_size
        own_slot = tables.gather(1, page[:, None]).squeeze(1).to(torch.int64) * self.block_size
        own_slot = own_slot + offset
        context = max_context or pages * self.block_size
        batch = PagedAttentionBatch(
            query_start=self.query_start[: B + 1],
            context_lengths=torch.where(run, position + 1, 1).to(torch.int32),
            block_tables=tables,
            write_slots=torch.where(run, own_slot, self.kv.scratch_slot),
            max_query_len=1,
            max_context_len=context,
        )
        state = rows.hidden[:B]
        starting = rows.loops[:B] == 0  # the looping token's first loop
        if self.stage is not None:  # a token's prelude runs in the tick of its first loop
            first = run & starting
            extra = {}
            if self.state_uniforms is not None:
                width = self.model.shape.hidden_size
                extra["uniforms"] = self.state_uniforms(rows.seed[:B], position, width)
            started = self._run_stage(
                self.model.embed, rows.token[:B], position, first, context, **extra
            )  # (reads no prelude weight in a tick where no row starts a token: `_run_stage`)
            state = torch.where(first[:, None], started, state)
        hidden, signal = self.model.recurrent_step(
            state,
            position,
            self.attention.bind(self.kv.tensors, batch),
            compute_gate=gate and not self.distribution_exits,
        )
        logits = None
        if self.distribution_exits:  # the coda (its KV rewritten each loop) and head first
            finished = hidden
            if self.stage is not None:
                finished = self._run_stage(self.model.finish, hidden, position, run, context)
            logits = self.model.coda(finished)
            signal, logprobs = self._distribution_change(logits, starting, B)
        decision = decide_exits(rows, B, loop_index, signal)
        exits = decision.exits & run
        if rows.loop_planes > 1:
            self._finalize_kv(B, exits, loop_index, page, offset, own_slot)
        exiting = None  # device int32 [1]: does some row exit (the head's `needed`)
        if logits is None:
            finished = hidden
            if self.stage is not None:  # the coda's layers, for the rows that exit
                exiting = _any_row(exits)
                finished = self._run_stage(
                    self.model.finish, hidden, position, exits, context, needed=exiting
                )
        else:
            rows.exit_logprobs[:B] = torch.where(run[:, None], logprobs, rows.exit_logprobs[:B])
        sampled = self._sample(
            finished, slice(0, B), rows.outputs[:B], mode, exiting, logits=logits
        )
        if mode.penalized:  # the counts the next token's penalties read
            rows.logits_state.output_counts[:B].scatter_add_(
                1, sampled.token_ids[:, None], exits[:, None].to(torch.int32)
            )
        outputs = rows.outputs[:B] + exits.to(torch.int64)
        stops = exits & self._stop_hit(sampled.token_ids, slice(0, B), outputs)
        self._record(B, exits, loop_index, sampled, mode)
        carry_on = exits & ~stops
        looping = run & ~exits
        kept = torch.where(looping[:, None], hidden, rows.hidden[:B])
        if self.stage is None:  # the next token's state (stage families: its prelude, next tick)
            kept = torch.where(carry_on[:, None], self.model.embed(sampled.token_ids), kept)
        rows.hidden[:B] = kept
        rows.token[:B] = torch.where(exits, sampled.token_ids, rows.token[:B])
        rows.position[:B] += carry_on.to(torch.int64)
        rows.loops[:B] = torch.where(exits, 0, torch.where(run, loop_index, rows.loops[:B]))
        rows.survival[:B] = torch.where(
            exits, 1.0, torch.where(run, decision.survival, rows.survival[:B])
        )
        rows.pending_exit[:B] = torch.where(
            exits, 0, torch.where(run, decision.pending_exit, rows.pending_exit[:B])
        )
        rows.outputs[:B] = outputs
        rows.active[:B] &= ~stops
        if self.cohort:
            rows.parked[:B] |= carry_on
        rows.held[:B] |= carry_on & rows.hold_after_output[:B]

    def _fused_tick(self, B: int, mode: SamplingMode, gate: bool, max_context: int | None) -> None:
        """The same tick with the bookkeeping in four Triton kernels (tick_kernels.py); the
        exit decision precedes the coda, which it tells whether any row exits."""
        kernels, rows = self.kernels, self.rows
        kernels.prepare(B)
        pages = rows.block_tables.shape[-1]
        plane = kernels.plane[:B].view(B, 1, 1).expand(B, 1, pages)
        batch = PagedAttentionBatch(
            query_start=self.query_start[: B + 1],
            context_lengths=kernels.context[:B],
            block_tables=rows.block_tables[:B].gather(1, plane).squeeze(1),
            write_slots=kernels.write_slot[:B],
            max_query_len=1,
            max_context_len=max_context or pages * self.block_size,
        )
        hidden, gate_probability = self.model.recurrent_step(
            rows.hidden[:B],
            rows.position[:B],
            self.attention.bind(self.kv.tensors, batch),
            compute_gate=gate,
        )
        kernels.decide(B, gate_probability)
        sampled = self._sample(hidden, slice(0, B), rows.outputs[:B], mode, kernels.coda_flag)
        embedded = self.model.embed(sampled.token_ids)
        kernels.commit(B, hidden, sampled, embedded, mode)
        self.tick_index += 1
        kernels.copy(B)

    def _distribution_change(self, logits, starting, B) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(p_prev || p) of each row's next-token distribution p after this loop, p_prev the
        previous loop's (uniform at a token's first loop); returns (KL [B] fp32, log p)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        uniform = -math.log(logprobs.shape[-1])
        previous = torch.where(starting[:, None], uniform, self.rows.exit_logprobs[:B])
        return (previous.exp() * (previous - logprobs)).sum(-1), logprobs

    def _run_stage(
        self, stage, inputs, position, writes, max_context, needed=None, **extra
    ) -> torch.Tensor:
        """A family's prelude (`embed`) or coda (`finish`) for rows [0, B) on the stage plane,
        storing KV only for the rows `writes`. The stage is told (`needed`, device int32 [1])
        whether any row runs it, so at a few rows a tick where none does reads none of its
        weights: at one request a token's prelude and coda weights are read once, not in each
        of its loops."""
        batch = self.stage.tick_batch(position.shape[0], position, writes, max_context)
        needed = _any_row(writes) if needed is None else needed  # (given: already computed)
        attention = self.attention.bind(self.kv.tensors, batch)
        return stage(inputs, position, attention, needed=needed, **extra)

    def _finalize_kv(self, B, exits, loop_index, page, offset, own_slot) -> None:
        """LAST_EXITED: a token that exits at loop e < T gets its plane e-1 KV copied into
        planes e..T-1, so later queries at any deeper loop read its last version. RING of K
        planes (`loop_planes` = K): the same copy into planes e..K-1, needed only when e < K
        (its planes e..K-1 were never written; at e >= K `loop_index <= plane` holds for none)."""
        scratch = self.kv.scratch_slot
        copies = exits & (loop_index < self.depth)
        sources, targets = [], []
        for plane in range(1, self.rows.loop_planes):
            table = self.rows.block_tables[:B, plane]
            target = table.gather(1, page[:, None]).squeeze(1).to(torch.int64) * self.block_size
            needed = copies & (loop_index <= plane)
            sources.append(torch.where(needed, own_slot, scratch))
            targets.append(torch.where(needed, target + offset, scratch))
        self.kv.copy_slots(torch.cat(sources), torch.cat(targets))

    def _sample(
        self, hidden, index, counter, mode: SamplingMode, needed=None, logits=None
    ) -> SampledRows:
        """Sample from the head's logits of `hidden` (or from `logits`, already computed)."""
        return self.sampler.sample_rows(
            self.model.coda(hidden, needed=needed) if logits is None else logits,
            counter=counter,
            mode=mode,
            **self.rows.sampling_keywords(index, mode),
        )

    def _stop_hit(self, token_ids, index, outputs) -> torch.Tensor:
        rows = self.rows
        stop_token = (token_ids[:, None] == rows.stop_ids[index]).any(dim=1)
        return stop_token | (outputs >= rows.max_tokens[index])

    def _record(self, B, exits, loop_index, sampled: SampledRows, mode: SamplingMode) -> None:
        values = record_values(exits, loop_index, sampled, mode)
        self.ring.narrow(1, 0, B).narrow(2, 0, values.shape[1]).index_copy_(
            0, self.tick_index, values[None]
        )
        self.tick_index += 1

    # -- rows whose prompt completed -----------------------------------------------------------
    def start_rows(
        self,
        index: torch.Tensor,
        prompt_lengths: torch.Tensor,
        mode: SamplingMode,
        *,
        depths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Coda of rows `index` [n] whose last prompt position left its state in `hidden`:
        sample token 0, make the rows decode from position P (unless token 0 already ends
        them). `depths` [n] int64: the loops of each row's state (None: full depth; prompts
        run at exit depth pass their last position's). Returns the record [n, columns] of
        token 0 (not read back here)."""
        rows = self.rows
        counter = torch.zeros_like(prompt_lengths)
        sampled = self._sample(rows.hidden[index], index, counter, mode)
        token = sampled.token_ids
        stops = self._stop_hit(token, index, counter + 1)
        if depths is None:
            depths = torch.full_like(prompt_lengths, self.depth)
        everyone = torch.ones_like(stops)
        record = record_values(everyone, depths, sampled, mode)
        if mode.penalized:
            rows.logits_state.count_outputs(index, token, torch.ones_like(stops))
        rows.token.index_copy_(0, index, token)
        rows.position.index_copy_(0, index, prompt_lengths)
        rows.outputs.index_copy_(0, index, counter + 1)
        rows.loops.index_copy_(0, index, counter)
        rows.pending_exit.index_copy_(0, index, counter)
        rows.survival.index_fill_(0, index, 1.0)
        rows.active.index_copy_(0, index, ~stops)
        rows.parked.index_copy_(0, index, ~stops if self.cohort else torch.zeros_like(stops))
        rows.held.index_copy_(0, index, ~stops & rows.hold_after_output[index])
        if self.stage is None:  # stage families: token 0's prelude runs in its first tick
            rows.hidden.index_copy_(0, index, self.model.embed(token))
        return record


def _any_row(rows: torch.Tensor) -> torch.Tensor:
    """Device int32 [1]: 1 where some row of the bool `rows` [B] is set (a `needed` flag)."""
    return rows.any().to(torch.int32).reshape(1)


def record_values(exits, depth, sampled, mode: SamplingMode) -> torch.Tensor:
    """[..., columns] fp64 of the entries [...] (rows, or a round's slots x positions): token (-1
    where no exit), depth (0 where no exit)[, logprob fields] of `sampled`'s tokens."""
    columns = [
        torch.where(exits, sampled.token_ids, -1).to(torch.float64)[..., None],
        torch.where(exits, depth, 0).to(torch.float64)[..., None],
    ]
    if mode.top_logprobs is not None:
        columns += [
            sampled.logprobs.to(torch.float64)[..., None],
            sampled.top_token_ids.to(torch.float64),
            sampled.top_logprobs.to(torch.float64),
        ]
    return torch.cat(columns, dim=-1)
