"""`SpeculativeProgram`: self-speculative rounds over the decoding rows, entirely on the device.

A round takes every decoding row (a "slot" here: `slot_row` maps slots to rows) from wherever
its current token is (between tokens, or mid-token after plain ticks) to the next token
boundary, emitting 1 .. drafted + 1 tokens. With K = num_drafts, D = draft_loops, T = depth
and p / o the position / output index of the row's current token:

    draft    for s = 0 .. K: position p + s runs its loops up to D (one model call per loop
             over the slots, as a tick does), applying the row's real exit rule; a token whose
             rule fires at e <= D has really exited (LAST_EXITED copies into planes e..T-1),
             the others stop at D with their exit state. For s < K the coda and the sampler's
             `propose_rows` (output index o + s, the draft stream) give draft s + 1, embedded as
             the input of position p + s + 1.
    verify   LAST_EXITED: loops D+1 .. T over all K + 1 positions of every slot at once (one
             model call per loop, one attention group of K + 1 queries per slot, all reading
             plane loop - 1); a position that exits stops, its KV copied into the deeper
             planes before the next loop reads them. The draft's loops 1..D are reused as they
             are: they applied the same rule to the same inputs, and a later position at loop
             j <= D reads the earlier positions' plane j - 1, which the draft wrote (or copied)
             exactly as decoding would have. SHARED: one plane holds each position's final
             version, which a later position must see at every loop, so positions run one
             after the other, each through all its loops (the current token continues from
             its draft state, the drafts restart from their embeddings): correct, no faster
             than decoding.
    accept   coda of every position at its exit depth, then the sampler's `verify_rows`:
             accepted drafts plus one token; stop ids and max_tokens cut the emitted run; the
             row continues at position p + emitted with its last token embedded (or stops).

Positions past what a row keeps (rejected drafts) leave KV garbage beyond its frontier: no
query reads a position past its own, and every plane of a position is rewritten (by a loop or
a finalization copy) before any later position reads it, so that is the whole rollback; the
scheduler's logical progress only ever advances by the emitted tokens it reads back.

Every shape is fixed by (slots, mode, gate): a round is capturable as one CUDA graph
(`speculative_graphs.py`). Rows that are not live in a round (free, prefilling, held, stopped)
and padding slots compute garbage that is never kept: their KV writes go to the scratch slot and
every row update is masked, so the write-back leaves them bitwise unchanged.

Records: the ring [rounds * (K + 1), slots, columns] (the decode ring's columns: token or -1,
depth, logprob fields) and `counts` [rounds, slots, 2] = (accepted, drafted) per round.
"""

from __future__ import annotations

import random

import torch
from rlt_contracts import (
    AttentionBackend,
    KVLayout,
    KVLayoutSpec,
    LoopedLanguageModel,
    SamplingMode,
    SpeculativeSampler,
)

from rlt_runner import speculative_kernels
from rlt_runner.decode_program import RING_COLUMNS
from rlt_runner.graph_capture import WARMUP_RUNS
from rlt_runner.kv_storage import KVStorage
from rlt_runner.loop_bookkeeping import kv_slots_of
from rlt_runner.position_loops import PositionLoops
from rlt_runner.row_state import DecodeRows
from rlt_runner.speculative_accept import accept_round
from rlt_runner.speculative_state import (
    Slots,
    load_column,
    load_every_position,
    store_column,
    store_every_position,
)
from rlt_runner.token_state import TokenState
from rlt_runner.transfers import upload


class SpeculativeProgram:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        sampler: SpeculativeSampler,
        kv: KVStorage,
        rows: DecodeRows,
        *,
        layout: KVLayoutSpec,
        cohort: bool,
        num_drafts: int,
        draft_loops: int,
        max_slots: int,
        max_rounds: int,
        max_model_len: int,
    ) -> None:
        depth = model.shape.num_loops
        if not 1 <= draft_loops < depth:
            raise ValueError(f"draft_loops must be in [1, {depth - 1}], got {draft_loops}")
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
        if layout.kind is KVLayout.RING:  # the engine refuses the pair at start-up
            raise ValueError(f"speculative rounds read last_exited or shared KV, not {layout}")
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.kv = kv
        self.rows = rows
        self.layout = layout.kind
        self.cohort = cohort
        self.num_drafts = num_drafts
        self.width = width = num_drafts + 1
        self.draft_loops = draft_loops
        self.depth = depth
        self.max_slots = max_slots
        device = rows.device
        L = max_slots

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.slot_row = zeros(L)
        self.slot_valid = zeros(L, dtype=torch.bool)
        self.hidden = zeros(L, width, rows.hidden.shape[1], dtype=rows.hidden.dtype)
        self.token = zeros(L, width)
        self.loops = zeros(L, width)
        self.survival = torch.ones(L, width, dtype=torch.float64, device=device)
        self.pending = zeros(L, width)
        self.exited = zeros(L, width, dtype=torch.bool)
        self.depths = zeros(L, width)
        self.draft_probabilities: torch.Tensor | None = None  # [L, K, V] fp32, on first use
        self.spare_round = max_rounds  # first record row of graph-capture warm-ups
        self.ring = zeros((max_rounds + WARMUP_RUNS) * width, L, RING_COLUMNS, dtype=torch.float64)
        self.counts = zeros(max_rounds + WARMUP_RUNS, L, 2, dtype=torch.float64)
        self.round_index = zeros(1)
        self.forced_accepted = zeros(max_rounds + WARMUP_RUNS, L)  # benchmarks only
        self.max_rounds = max_rounds
        self.offsets = torch.arange(width, device=device)
        # query_start of K + 1 queries per slot
        self.slot_starts = torch.arange(L + 1, dtype=torch.int32, device=device) * width
        self.forcing = False  # set by `force_acceptance` (benchmarks), never by an engine option
        self._forced_rate: float | None = None
        self._forced_random = random.Random(0)
        # the loop machinery shared with exit-depth prompt scoring (position_loops.py)
        self.position_loops = PositionLoops(
            model, attention, kv, rows, max_position=max_model_len - 1
        )
        # the per-loop bookkeeping in Triton kernels on CUDA (else loop_bookkeeping.py's torch
        # ops), with buffers for every position of a round: max_slots x (K + 1)
        if device.type == "cuda" and speculative_kernels.available():
            self.bookkeeping = speculative_kernels.SpeculativeKernels(self)

    @property
    def bookkeeping(self):
        """The per-loop bookkeeping of the round's loops (the torch reference or the kernels)."""
        return self.position_loops.bookkeeping

    @bookkeeping.setter
    def bookkeeping(self, value) -> None:
        self.position_loops.bookkeeping = value

    @property
    def loops_per_round(self) -> int:
        """Token-loops a round runs per slot (padding included): the draft's (K + 1) x D, then
        the verify's (T - D) x (K + 1) (LAST_EXITED) or (T - D) + K x T (SHARED)."""
        verify_loops = self.depth - self.draft_loops
        if self.layout is KVLayout.LAST_EXITED:
            verify = verify_loops * self.width
        else:
            verify = verify_loops + self.num_drafts * self.depth
        return self.width * self.draft_loops + verify

    def begin_step(self, rows: list[int], num_slots: int, rounds: int) -> None:
        """Map slots [0, len(rows)) to these rows and pad to `num_slots` with a row that is not
        among them (its state is left as it is), in one small upload; the step's `rounds`
        record from round 0. Under `force_acceptance` the rounds' accepted counts are drawn
        here (host) and uploaded with the map."""
        count = len(rows)
        if num_slots > count:  # rows are fewer than the table's: one of the others exists
            taken = set(rows)
            filler = next(row for row in range(count + 1) if row not in taken)
            rows = rows + [filler] * (num_slots - count)
        columns = [rows, [1] * count + [0] * (num_slots - count)]
        if self.forcing:
            columns += self._forced_counts(rounds, num_slots)
        values = upload(columns, torch.int64, self.rows.device)
        self.slot_row[:num_slots].copy_(values[0])
        self.slot_valid[:num_slots].copy_(values[1].bool())
        if self.forcing:
            self.forced_accepted[:rounds, :num_slots].copy_(values[2:])
        self.round_index.zero_()

    def force_acceptance(self, rate: float | None, *, seed: int = 0) -> None:
        """Benchmarks only (no engine option reaches it): replace the verifier's acceptance by
        accepted lengths drawn on the host, each draft accepted with probability `rate` until
        the first rejection (capped at the row's drafts), so random weights can be timed at a
        trained model's acceptance; the tokens emitted are the drafts then the target's token.
        None restores real verification."""
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.forcing = rate is not None
        self._forced_rate = rate
        self._forced_random = random.Random(seed)

    def _forced_counts(self, rounds: int, count: int) -> list[list[int]]:
        draw, rate = self._forced_random.random, self._forced_rate
        counts = []
        for _ in range(rounds):
            row = []
            for _ in range(count):
                accepted = 0
                while accepted < self.num_drafts and draw() < rate:
                    accepted += 1
                row.append(accepted)
            counts.append(row)
        return counts

    # -- one round -----------------------------------------------------------------------------
    def round(
        self, num_slots: int, mode: SamplingMode, gate: bool, max_context: int | None = None
    ) -> None:
        """One round for slots [0, num_slots). `gate`: some row's rule reads the exit gate.
        max_context (host int) bounds the keys any position can see (None: the table width,
        as graphs need)."""
        slots = self.gather_slots(num_slots)
        self.draft(slots, mode, gate, max_context)
        self.verify(slots, gate, max_context)
        self.accept(slots, mode)

    # The phases of a round, public so that benchmarks can time each one as its own graph.
    def gather_slots(self, num_slots: int) -> Slots:
        """What the round reads of its rows at its start (speculative_state.Slots)."""
        return Slots.gather(self.rows, self, num_slots)

    def verify(self, slots: Slots, gate: bool, max_context: int | None = None) -> None:
        """Every position from its draft state to its exit (module doc)."""
        if self.layout is KVLayout.LAST_EXITED:
            self._verify_depth_major(slots, gate, max_context)
        else:
            self._verify_position_by_position(slots, gate, max_context)

    def draft(
        self, slots: Slots, mode: SamplingMode, gate: bool, max_context: int | None = None
    ) -> None:
        """Positions p .. p + K through their first D loops, drafts from the coda."""
        rows, n = self.rows, slots.count
        state = TokenState(
            hidden=rows.hidden[slots.index],
            loops=rows.loops[slots.index],
            survival=rows.survival[slots.index],
            pending=rows.pending_exit[slots.index],
            position=slots.position,
            output_index=slots.outputs,
        )
        token = rows.token[slots.index]
        for s in range(self.width):
            on = slots.position_valid[:, s]
            state.kv_slots = self.bookkeeping.position_slots(slots.tables, state.position)
            self._advance(slots, state, on, self.draft_loops, self.draft_loops, gate, max_context)
            self.token[:n, s] = token
            store_column(state, self, n, s)
            if s == self.num_drafts:
                break
            proposal = self.sampler.propose_rows(
                self.model.coda(state.hidden),
                counter=state.output_index,
                mode=mode,
                **rows.sampling_keywords(slots.index, mode),
            )
            token = proposal.token_ids
            if proposal.probabilities is not None:
                self.draft_probabilities_buffer()[:n, s] = proposal.probabilities
            state = TokenState.fresh(
                self.model.embed(token), state.position + 1, state.output_index + 1
            )

    def _verify_depth_major(self, slots: Slots, gate: bool, max_context) -> None:
        """LAST_EXITED: loops D+1..T over every slot's K + 1 positions at once, one attention
        group of K + 1 queries per slot reading plane loop - 1 (the split-KV kernels load each
        key once for all of them)."""
        n, width = slots.count, self.width
        state = load_every_position(self, n)
        on = slots.position_valid.reshape(-1)
        tables = slots.tables.repeat_interleave(width, dim=0)  # [n * width, planes, pages]
        state.kv_slots = kv_slots_of(tables, state.position, self.kv.block_size)
        self.position_loops.depth_major(
            state,
            slots.rules.repeat(width),
            on,
            group_tables=slots.tables,
            query_start=self.slot_starts[: n + 1],
            context_lengths=(slots.position + width).to(torch.int32),
            max_query_len=width,
            loops=range(self.draft_loops + 1, self.depth + 1),
            gate=gate,
            max_context=max_context or tables.shape[-1] * self.kv.block_size,
        )
        if not self.bookkeeping.in_place:
            store_every_position(state, self, n)

    def _verify_position_by_position(self, slots: Slots, gate: bool, max_context) -> None:
        """SHARED: position s runs all its loops before position s + 1 starts."""
        n = slots.count
        for s in range(self.width):
            if s == 0:  # the current token: its draft loops saw every earlier position final
                state = load_column(self, n, 0)
                loops = self.depth - self.draft_loops
            else:  # a draft: restarts from its embedding
                state = TokenState.fresh(
                    self.model.embed(self.token[:n, s]), slots.position + s, slots.outputs + s
                )
                loops = self.depth
            state.kv_slots = self.bookkeeping.position_slots(slots.tables, state.position)
            on = slots.position_valid[:, s]
            self._advance(slots, state, on, self.depth, loops, gate, max_context)
            store_column(state, self, n, s)

    def _advance(
        self,
        slots: Slots,
        state: TokenState,
        on: torch.Tensor,
        loop_cap: int,
        iterations: int,
        gate: bool,
        max_context: int | None,
    ) -> None:
        """`iterations` loops of one position per slot (a tick's model call), for the slots
        `on` whose token has not exited and has run fewer than `loop_cap` loops."""
        self.position_loops.one_position(
            state,
            slots.rules,
            on,
            tables=slots.tables,
            loop_cap=loop_cap,
            iterations=iterations,
            gate=gate,
            max_context=max_context or slots.tables.shape[-1] * self.kv.block_size,
        )

    def accept(self, slots: Slots, mode: SamplingMode) -> None:
        """Coda and verification of every position, records, the rows' new state
        (speculative_accept.py); the next round records after this one."""
        accept_round(self, slots, mode)
        self.round_index += 1

    # -- helpers -------------------------------------------------------------------------------
    def draft_probabilities_buffer(self) -> torch.Tensor:
        """[L, K, V] fp32 draft distributions, allocated on first use."""
        if self.draft_probabilities is None:
            vocab = self.model.shape.vocab_size
            self.draft_probabilities = torch.zeros(
                self.max_slots, self.num_drafts, vocab, device=self.rows.device
            )
        return self.draft_probabilities
