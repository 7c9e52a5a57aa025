"""One asynchronous read-back per step, and its parsing into `GeneratedTokens` (R18, R21).

A submitted step queues a single device-to-host copy of everything it recorded (token 0 of the
prompts it completed, then its ticks' ring rows) into pinned memory and records an event after
it. `collect` waits on that event only: the one point where the host waits for the device.
Rows are attributed to the request that owned them when the step was submitted (its `RowRecord`,
whose identity carries the generation), so a late result never reaches a request that reuses
the id or the row (R17).

Progress points (R18; README.md, "Progress points"): `finish_readback` reports the queued prompt
chunks (`queued_progress`) only once the step's `StepCompletion` evidence holds; a step with
queued chunks and no evidence is an error, never a report.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from rlt_contracts import (
    ExecutionFailure,
    GeneratedTokens,
    ModelRunnerOutput,
    PrefillProgress,
    SamplingMode,
    SpeculationCounts,
)

from rlt_runner.decode_program import record_columns
from rlt_runner.prompt_scoring import unpack
from rlt_runner.row_record import RowRecord
from rlt_runner.transfers import download


class StepCompletion(enum.Enum):
    """What establishes that a submitted step's device work has finished."""

    UNKNOWN = "unknown"  # nothing yet (not submitted to the end, or failed)
    EVENT = "event"  # `PendingStep.event`, recorded after all of the step's work (CUDA)
    SYNCHRONOUS = "synchronous"  # the device ran the work inside submit (CPU)


@dataclass
class PendingStep:
    """A submitted step: what it recorded is on its way to `host` (valid once `event` is done).

    started: rows whose prompt completed (their token-0 record comes first in `host`);
    owners: the record of every decode row [0, rows) at submission (None: free row), or, in a
      speculative step, of every slot;
    ticks: ring rows recorded (a speculative step: rounds x (drafts + 1));
    speculative_rounds / drafts: a speculative step's rounds and the engine's drafts per round
      (its per-round (accepted, drafted) counts follow the ring in `host`);
    loop_slots: rows x loops the step's decode ran (padding included);
    queued_progress: prompt chunks submitted (reported only with completion evidence);
    prompt_scores: (record, first scored token, rows on their way to the host) per scored chunk
      (prompt_scoring.py), reported with the same evidence;
    failures: operations that failed (their requests are named); step_failed: the whole step
      failed, so it reports nothing else.
    """

    step_id: int
    mode: SamplingMode = SamplingMode()
    started: list[RowRecord] = field(default_factory=list)
    owners: list[RowRecord | None] = field(default_factory=list)
    ticks: int = 0
    rows: int = 0
    speculative_rounds: int = 0
    drafts: int = 0
    loop_slots: int = 0
    queued_progress: tuple[PrefillProgress, ...] = ()
    prompt_scores: list[tuple[RowRecord, int, torch.Tensor]] = field(default_factory=list)
    host: torch.Tensor | None = None
    start_event: torch.cuda.Event | None = None  # recorded before the step's first operation
    event: torch.cuda.Event | None = None
    completion: StepCompletion = StepCompletion.UNKNOWN
    failures: list[ExecutionFailure] = field(default_factory=list)
    step_failed: bool = False


def mark_step_start(pending: PendingStep, device: torch.device) -> None:
    """On CUDA, a timing event before the step's first operation: against the previous step's
    `event` it gives how long the device sat idle before this step (its stream reaches the event
    at once when the host submits late, or when the previous step's work ends)."""
    if device.type == "cuda":
        pending.start_event = torch.cuda.Event(enable_timing=True)
        pending.start_event.record()


def start_readback(
    pending: PendingStep,
    started_record: torch.Tensor | None,
    ring: torch.Tensor,
    device: torch.device,
    counts: torch.Tensor | None = None,
) -> None:
    """Queue the one copy of this step's records: [started rows, columns], the ring's
    [ticks, rows, columns] block and, for a speculative step, `counts`' [rounds, slots, 2]
    block, flattened into one fp64 tensor, and establish how completion will be known. On CUDA
    every step records its event after all its work, also one with nothing to read back
    (prefill only): collecting it is the evidence that its device work (e.g. a chunk's KV,
    before its progress is reported or a transfer reads it) is complete."""
    parts = []
    if started_record is not None:
        parts.append(started_record.reshape(-1))
    if pending.ticks:
        columns = record_columns(pending.mode)
        parts.append(ring[: pending.ticks, : pending.rows, :columns].reshape(-1))
    if pending.speculative_rounds and counts is not None:
        parts.append(counts[: pending.speculative_rounds, : pending.rows].reshape(-1))
    if parts:
        pending.host = download(torch.cat(parts) if len(parts) > 1 else parts[0])
    if device.type == "cuda":
        # Timing-enabled: consecutive steps' events give their spacing on the device clock.
        pending.event = torch.cuda.Event(enable_timing=True)
        pending.event.record()
        pending.completion = StepCompletion.EVENT
    elif device.type == "cpu":
        pending.completion = StepCompletion.SYNCHRONOUS


def finish_readback(pending: PendingStep) -> tuple[ModelRunnerOutput, float]:
    """Wait for the step's copy (the only wait), then attribute every recorded token.
    Returns the output and the seconds spent waiting."""
    start = time.perf_counter()
    if pending.event is not None:
        pending.event.synchronize()
    waited = time.perf_counter() - start
    failures = tuple(pending.failures)
    if pending.step_failed:
        return ModelRunnerOutput(step_id=pending.step_id, failures=failures), waited
    completed = pending.completion is StepCompletion.SYNCHRONOUS or (
        pending.completion is StepCompletion.EVENT and pending.event is not None
    )
    if not completed:
        raise RuntimeError(
            f"step {pending.step_id} has no completion evidence ({pending.completion.value}); "
            "its prompt progress and records cannot be reported"
        )
    tokens: dict[int, _Collected] = {}
    speculation = None
    if pending.host is not None:
        columns = record_columns(pending.mode)
        host = pending.host
        if pending.speculative_rounds:
            size = pending.speculative_rounds * pending.rows * 2
            speculation = _speculation_counts(host[-size:].view(-1, pending.rows, 2), pending)
            host = host[:-size]
        values = host.view(-1, columns)
        started = len(pending.started)
        for record, row_values in zip(pending.started, values[:started].tolist(), strict=True):
            _collected(tokens, record).add(row_values)
        if pending.ticks:
            ring = values[started:].view(pending.ticks, pending.rows, columns)
            emitted = (ring[:, :, 0] >= 0).nonzero().tolist()
            entries = ring[ring[:, :, 0] >= 0].tolist()
            for (_, row), row_values in zip(emitted, entries, strict=True):
                record = pending.owners[row]
                if record is not None:
                    _collected(tokens, record).add(row_values)
    output = ModelRunnerOutput(
        step_id=pending.step_id,
        generated=tuple(c.build() for c in tokens.values()),
        prefill_progress=pending.queued_progress,  # device completion established above
        failures=failures,
        decode_ticks=0 if pending.speculative_rounds else pending.ticks,
        loop_slots=pending.loop_slots,
        speculative_rounds=pending.speculative_rounds,
        speculation=speculation,
        prompt_logprobs=tuple(
            unpack(
                record.identity,
                first,
                host,
                record.sampling.prompt_logprobs or 0,
                with_exit_depths=record.sampling.score_at_exit_depth,
            )
            for record, first, host in pending.prompt_scores
        ),
    )
    return output, waited


def _speculation_counts(counts: torch.Tensor, pending: PendingStep) -> SpeculationCounts:
    """Sum the rounds' (accepted, drafted) pairs of the slots that had an owner."""
    owned = [slot for slot, owner in enumerate(pending.owners) if owner is not None]
    pairs = counts[:, owned].reshape(-1, 2).tolist()
    per_position = [0] * pending.drafts
    drafts = draft_tokens = accepted_tokens = 0
    for accepted, drafted in pairs:
        if drafted <= 0:
            continue
        drafts += 1
        draft_tokens += int(drafted)
        accepted_tokens += int(accepted)
        for position in range(int(accepted)):
            per_position[position] += 1
    return SpeculationCounts(drafts, draft_tokens, accepted_tokens, tuple(per_position))


class _Collected:
    def __init__(self, record: RowRecord) -> None:
        self.record = record
        self.first = record.reported
        self.values: list[list[float]] = []

    def add(self, row_values: list[float]) -> None:
        self.values.append(row_values)
        self.record.reported += 1

    def build(self) -> GeneratedTokens:
        wanted = self.record.sampling.logprobs
        logprobs = top = None
        if wanted is not None:
            k = (len(self.values[0]) - 3) // 2
            keep = min(wanted, k)
            logprobs = tuple(v[2] for v in self.values)
            top = tuple(
                tuple((int(v[3 + j]), v[3 + k + j]) for j in range(keep)) for v in self.values
            )
        return GeneratedTokens(
            identity=self.record.identity,
            first_output_index=self.first,
            token_ids=tuple(int(v[0]) for v in self.values),
            exit_depths=tuple(int(v[1]) for v in self.values),
            logprobs=logprobs,
            top_logprobs=top,
        )


def _collected(tokens: dict[int, _Collected], record: RowRecord) -> _Collected:
    entry = tokens.get(id(record))
    if entry is None:
        entry = tokens[id(record)] = _Collected(record)
    return entry
