"""`DecodeRows`: the device state of every running request, one persistent row each (M5).

Each request with device state owns one row index into buffers that live as long as the runner
(so CUDA graphs can read and write them in place). Rows are handed out lowest-first, so the
rows in use stay packed at the front and a decode tick runs the smallest bucket that covers them.

Per-row device buffers (S rows); the runner writes them at admission, the decode program at
every tick (nobody else writes them):
  hidden [S, d]        the state the next loop reads (after an exit: the embedded new token)
  landing [S, d]       PD decode: the final prompt state a prefill instance writes (remote DMA)
  token [S]            the latest sampled token (the one looping)
  position [S]         its position (prompt length + outputs - 1)
  loops [S]            loops it has run so far
  survival [S] fp64    prod(1 - lambda_j) over those loops (the hazard exit state)
  pending_exit [S]     DELAYED_HAZARD: the loop after which it exits (0: none yet)
  outputs [S]          outputs produced so far (token 0 included) = the next output's index
  active [S] bool      decoding on the device (cleared when a stop rule fires or on release)
  parked [S] bool      cohort decoding: sampled, waiting for the cohort to drain
  held [S] bool        structured output: sampled its one token of the step, waiting for the
                       next token mask (set on output if `hold_after_output`, cleared by
                       `apply_token_masks`); a held row neither loops nor samples
  hold_after_output [S] bool: the rule's `one_output_per_step`
  rule_kind .. speculative_tokens, temperature .. min_tokens: the request's `DecodeRule` and
                       sampling parameters (stop_ids [S, C] padded with -1; speculative_tokens:
                       drafts per round; the adjustments' neutral values 1, 0, 0, 0, 0)
  block_tables [S, planes, pages] int32: physical block of every page of every plane; pages not
                       allocated point at the scratch block, so a stray write never lands in a
                       block some other request holds.

`logits_state` (logits_state.py) holds the lazily allocated [S, V]-sized state of the logits
adjustments and structured output (output counts, prompt and stop masks, logit_bias table,
token bitmask); `assign` activates it for the new rows.
"""

from __future__ import annotations

import heapq

import torch
from rlt_contracts import (
    BlockTableUpdate,
    ExecutionIdentity,
    ExitRuleKind,
    LogitsAdjustments,
    SamplingMode,
)

from rlt_runner.logits_state import LogitsState
from rlt_runner.row_record import RowRecord
from rlt_runner.transfers import upload

HAZARD_CODE, DELAYED_CODE, TRACE_CODE, LATENT_CODE, DELAYED_LATENT_CODE = 0, 1, 2, 3, 4
KL_CODE, DELAYED_KL_CODE = 5, 6
# Per-row int64 / fp32 parameters written at activation, in upload column order.
INT_FIELDS = (
    "rule_kind",
    "min_loops",
    "max_loops",
    "max_tokens",
    "top_k",
    "seed",
    "min_tokens",
    "speculative_tokens",
)
FLOAT32_FIELDS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_p",
)
RULE_CODES = {
    ExitRuleKind.HAZARD: HAZARD_CODE,
    ExitRuleKind.DELAYED_HAZARD: DELAYED_CODE,
    ExitRuleKind.TRACE: TRACE_CODE,
    ExitRuleKind.LATENT_DIFF: LATENT_CODE,
    ExitRuleKind.DELAYED_LATENT_DIFF: DELAYED_LATENT_CODE,
    ExitRuleKind.KL: KL_CODE,
    ExitRuleKind.DELAYED_KL: DELAYED_KL_CODE,
}

# Buffers that hold a row's progress (saved by snapshots; reset at admission).
PROGRESS_BUFFERS = (
    "hidden",
    "token",
    "position",
    "loops",
    "survival",
    "pending_exit",
    "exit_logprobs",
    "outputs",
    "active",
    "parked",
    "held",
)


class DecodeRows:
    def __init__(
        self,
        *,
        max_rows: int,
        num_planes: int,
        max_pages: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_block: int,
        stop_capacity: int = 8,
        trace_capacity: int = 1,
        vocab_size: int = 1,
        eos_token_ids: tuple[int, ...] = (),
        stage_planes: int = 0,
        exit_distribution_width: int = 1,
    ) -> None:
        """`num_planes` KV planes per page: the loop planes, then `stage_planes` (0 or 1) for
        the family's prelude and coda layers (stage_plane.py)."""
        self.device = device
        self.num_planes = num_planes
        self.loop_planes = num_planes - stage_planes
        self.stage_plane = self.loop_planes if stage_planes else None
        self.max_pages = max_pages
        self.scratch_block = scratch_block
        self.stop_capacity = stop_capacity
        self.trace_capacity = trace_capacity
        S = max_rows

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.hidden = zeros(S, hidden_size, dtype=dtype)
        # PD decode: a prefill instance writes a prompt's final state here (never touched by a
        # tick, which rewrites every row's `hidden`); copied into `hidden` at its remote start.
        self.landing = zeros(S, hidden_size, dtype=dtype)
        self.token = zeros(S)
        self.position = zeros(S)
        self.loops = zeros(S)
        self.survival = torch.ones(S, dtype=torch.float64, device=device)
        self.pending_exit = zeros(S)
        # the KL rules' previous next-token log-distribution of each row's looping token
        # ([S, V] fp32 when the engine's policy reads it, else [S, 1] unused)
        self.exit_logprobs = zeros(S, exit_distribution_width, dtype=torch.float32)
        self.outputs = zeros(S)
        self.active = zeros(S, dtype=torch.bool)
        self.parked = zeros(S, dtype=torch.bool)
        self.held = zeros(S, dtype=torch.bool)
        self.hold_after_output = zeros(S, dtype=torch.bool)
        self.rule_kind = zeros(S)
        self.min_loops = torch.ones(S, dtype=torch.int64, device=device)
        self.max_loops = torch.ones(S, dtype=torch.int64, device=device)
        self.threshold = torch.ones(S, dtype=torch.float64, device=device)
        self.trace = zeros(S, trace_capacity, dtype=torch.int8)
        self.max_tokens = torch.ones(S, dtype=torch.int64, device=device)
        self.speculative_tokens = zeros(S)
        self.stop_ids = torch.full((S, stop_capacity), -1, dtype=torch.int64, device=device)
        self.temperature = zeros(S, dtype=torch.float32)
        self.top_k = zeros(S)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.seed = zeros(S)
        self.repetition_penalty = torch.ones(S, dtype=torch.float32, device=device)
        self.frequency_penalty = zeros(S, dtype=torch.float32)
        self.presence_penalty = zeros(S, dtype=torch.float32)
        self.min_p = zeros(S, dtype=torch.float32)
        self.min_tokens = zeros(S)
        self.logits_state = LogitsState(
            max_rows=S, vocab_size=vocab_size, eos_token_ids=eos_token_ids, device=device
        )
        self.block_tables = torch.full(
            (S, num_planes, max_pages), scratch_block, dtype=torch.int32, device=device
        )
        self._free = list(range(S))
        self._records: dict[ExecutionIdentity, RowRecord] = {}

    # -- host view -----------------------------------------------------------------------------
    def __contains__(self, identity: ExecutionIdentity) -> bool:
        return identity in self._records

    def __len__(self) -> int:
        return len(self._records)

    def identities(self) -> list[ExecutionIdentity]:
        return list(self._records)

    def record(self, identity: ExecutionIdentity) -> RowRecord:
        try:
            return self._records[identity]
        except KeyError:
            raise RuntimeError(f"runner has no state for {identity}") from None

    def decoding_records(self) -> list[RowRecord]:
        return [r for r in self._records.values() if r.decoding]

    def row_owners(self, num_rows: int) -> list[RowRecord | None]:
        """The record owning each of rows [0, num_rows) right now (None: free row)."""
        owners: list[RowRecord | None] = [None] * num_rows
        for record in self._records.values():
            if record.row < num_rows:
                owners[record.row] = record
        return owners

    # -- admission and release -----------------------------------------------------------------
    def assign(self, records: list[RowRecord]) -> None:
        """Give each record (row unset) the lowest free row and write its rule, sampling
        parameters and fresh progress to the device (a few uploads for the whole batch)."""
        if not records:
            return
        for record in records:
            if record.identity in self._records:
                raise RuntimeError(f"{record.identity} already has a runner row")
            if not self._free:
                raise RuntimeError("no free runner row (more running requests than max_num_seqs)")
            record.row = heapq.heappop(self._free)
            record.host_tables = [[] for _ in range(self.num_planes)]
            self._records[record.identity] = record
        index = upload([r.row for r in records], torch.int64, self.device)
        ints = [self._int_fields(r) for r in records]
        ints_dev = upload(ints, torch.int64, self.device)
        columns = iter(ints_dev.unbind(1))
        for name in INT_FIELDS:
            getattr(self, name).index_copy_(0, index, next(columns))
        self.stop_ids.index_copy_(0, index, ints_dev[:, len(INT_FIELDS) :])
        floats = upload([_float_fields(r) for r in records], torch.float64, self.device)
        self.threshold.index_copy_(0, index, floats[:, 0])
        for column, name in enumerate(FLOAT32_FIELDS, start=1):
            getattr(self, name).index_copy_(0, index, floats[:, column].float())
        self.logits_state.write_adjustments(records, index)
        self._write_hold_flags(records, index)
        self.logits_state.reset_token_masks(records, index)
        if any(r.rule.exit.kind is ExitRuleKind.TRACE for r in records):
            self.trace.index_copy_(0, index, upload(self._traces(records), torch.int8, self.device))
        self.block_tables.index_fill_(0, index, self.scratch_block)
        self.reset_progress(index)

    def _int_fields(self, record: RowRecord) -> list[int]:
        rule = record.rule
        stops = list(rule.stop_token_ids[: self.stop_capacity])
        stops += [-1] * (self.stop_capacity - len(stops))
        return [
            RULE_CODES[rule.exit.kind],
            rule.exit.min_loops,
            rule.exit.max_loops,
            rule.max_tokens,
            record.sampling.top_k,
            record.sampling.seed,
            record.sampling.min_tokens,
            rule.num_speculative_tokens,
            *stops,
        ]

    # -- logits adjustments --------------------------------------------------------------------
    def adjustments(self, index: slice | torch.Tensor) -> LogitsAdjustments:
        """Views (slice) or gathered copies (index tensor) of the rows' adjustment state; the
        groups not allocated yet are None (their mode flags cannot be set then)."""

        def rows_of(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[index]

        state = self.logits_state
        return LogitsAdjustments(
            output_counts=rows_of(state.output_counts),
            prompt_mask=rows_of(state.prompt_mask),
            repetition_penalty=self.repetition_penalty[index],
            frequency_penalty=self.frequency_penalty[index],
            presence_penalty=self.presence_penalty[index],
            bias_token_ids=rows_of(state.bias_token_ids),
            bias_values=rows_of(state.bias_values),
            min_tokens=self.min_tokens[index],
            stop_mask=rows_of(state.stop_mask),
            token_bitmask=rows_of(state.token_bitmask),
        )

    def sampling_keywords(self, index: slice | torch.Tensor, mode: SamplingMode) -> dict:
        """The sampler's per-row keywords for rows `index` (views for a slice, gathered copies
        for a tensor); min_p and the logits adjustments only in a mode that reads them."""
        keywords = {
            "temperature": self.temperature[index],
            "top_k": self.top_k[index],
            "top_p": self.top_p[index],
            "seed": self.seed[index],
        }
        if mode.min_p:
            keywords["min_p"] = self.min_p[index]
        if mode.adjusts_logits:
            keywords["adjustments"] = self.adjustments(index)
        return keywords

    def _traces(self, records: list[RowRecord]) -> list[list[int]]:
        rows = []
        for record in records:
            rule, capacity = record.rule.exit, self.trace_capacity
            if rule.kind is ExitRuleKind.TRACE and len(rule.trace_depths) > capacity:
                raise ValueError(
                    f"{record.identity}: trace of {len(rule.trace_depths)} depths "
                    f"exceeds the runner's trace capacity {capacity}"
                )
            depths = list(rule.trace_depths[:capacity])
            rows.append(depths + [rule.max_loops] * (capacity - len(depths)))
        return rows

    # -- structured output ---------------------------------------------------------------------
    def _write_hold_flags(self, records: list[RowRecord], index: torch.Tensor) -> None:
        """Hold flags from the rules (`one_output_per_step`)."""
        constrained = [r.rule.one_output_per_step for r in records]
        self.hold_after_output.index_copy_(0, index, upload(constrained, torch.bool, self.device))

    def apply_token_masks(self, masks: list[tuple[RowRecord, bytes]]) -> None:
        """Write each record's next-token bitmask (little-endian int32 words) into its row and
        release the row's hold: it may sample one more token. One pinned upload."""
        if not masks:
            return
        index = self.logits_state.write_token_masks([(r.row, m) for r, m in masks])
        self.held.index_fill_(0, index, False)

    def reset_progress(self, index: torch.Tensor) -> None:
        """Rows `index` hold no token yet: inactive, no loops, no outputs."""
        for name in ("token", "position", "loops", "pending_exit", "outputs"):
            getattr(self, name).index_fill_(0, index, 0)
        self.survival.index_fill_(0, index, 1.0)
        self.active.index_fill_(0, index, False)
        self.parked.index_fill_(0, index, False)
        self.held.index_fill_(0, index, False)

    def release(self, identities: list[ExecutionIdentity]) -> list[RowRecord]:
        """Free the rows of `identities` (unknown ones are skipped) and deactivate them on the
        device, in stream order after the work already submitted."""
        released = [self._records.pop(i) for i in identities if i in self._records]
        for record in released:  # host bookkeeping first: it stays consistent if the device fails
            heapq.heappush(self._free, record.row)
        if released:
            index = upload([r.row for r in released], torch.int64, self.device)
            self.active.index_fill_(0, index, False)
            self.parked.index_fill_(0, index, False)
        return released

    def apply_block_updates(
        self, updates: list[tuple[ExecutionIdentity, tuple[BlockTableUpdate, ...]]]
    ) -> None:
        """Write block-table growth of several requests with one upload of (index, block)."""
        flat_index, blocks = [], []
        for identity, request_updates in updates:
            record = self.record(identity)
            for update in request_updates:
                table = record.host_tables[update.plane]
                del table[update.first_page :]
                table.extend(update.block_ids)
                base = (record.row * self.num_planes + update.plane) * self.max_pages
                for offset, block in enumerate(update.block_ids):
                    flat_index.append(base + update.first_page + offset)
                    blocks.append(block)
        if flat_index:
            pairs = upload([flat_index, blocks], torch.int64, self.device)
            self.block_tables.view(-1).index_copy_(0, pairs[0], pairs[1].to(torch.int32))

    def allocated_tokens(self, record: RowRecord, block_size: int) -> int:
        return len(record.host_tables[0]) * block_size


def _float_fields(record: RowRecord) -> list[float]:
    """threshold (fp64), then FLOAT32_FIELDS, as one upload row."""
    sampling = record.sampling
    return [
        record.rule.exit.threshold,
        sampling.temperature,
        sampling.top_p,
        sampling.repetition_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        sampling.min_p,
    ]
