"""`ModelRunner`: executes `SchedulerOutput`s on the device and reports `ModelRunnerOutput`s.

Submission and completion are separate calls (R18): `submit(step)` queues all of a step's device
work (bookkeeping uploads, prefill, token 0 of completed prompts, K decode ticks or speculative
rounds, one read-back copy) and returns at once with a `PendingStep`; `collect(pending)` waits
for that step's copy and parses it. Inside a step nothing waits for the device; on the CPU both
calls are synchronous, with identical results. Failures are reported, never raised (README.md,
"Failure protocol"; step_bookkeeping.py).
"""

from __future__ import annotations

import logging

import torch
from rlt_contracts import (
    AttentionBackend,
    ConfigurationError,
    ExecutionFailure,
    ExecutionIdentity,
    FailedOperation,
    KVLayout,
    LoopedLanguageModel,
    ModelRunnerOutput,
    PrefillChunk,
    PrefillProgress,
    RunnerConfig,
    SamplingMode,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingMode,
    TokenSampler,
)
from rlt_contracts.sampling import MAX_TOP_LOGPROBS

from rlt_runner.decode_graphs import DecodeGraphs
from rlt_runner.decode_program import DecodeProgram
from rlt_runner.kv_storage import FP8, KVScales, KVStorage
from rlt_runner.pd_regions import PDRegions
from rlt_runner.position_loops import PositionLoops
from rlt_runner.prefill_graphs import PrefillGraphs
from rlt_runner.prompt_chunks import run_prompt_chunks, token0_depths
from rlt_runner.readback import PendingStep, finish_readback, mark_step_start, start_readback
from rlt_runner.row_record import RowRecord
from rlt_runner.row_state import DecodeRows
from rlt_runner.shared_prefill import SharedPrefillGraphs
from rlt_runner.snapshots import SnapshotStore
from rlt_runner.speculative_graphs import SpeculativeGraphs
from rlt_runner.speculative_program import SpeculativeProgram
from rlt_runner.step_bookkeeping import RECOVERABLE_ERRORS, StepBookkeeping, step_identities
from rlt_runner.transfers import upload

logger = logging.getLogger(__name__)


def sampling_mode(
    params: list[SamplingParams], *, min_tokens_reached: bool = False
) -> SamplingMode:
    """The sampling work a batch of rows with these parameters needs (a feature at its
    neutral value in every row adds no work). min_tokens_reached: every row is known to have
    generated at least its min_tokens (the mask is then left out)."""
    random = [p for p in params if not p.greedy]
    wants_logprobs = any(p.logprobs is not None for p in params)
    return SamplingMode(
        random=bool(random),
        filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in random),
        top_logprobs=MAX_TOP_LOGPROBS if wants_logprobs else None,
        penalized=any(p.penalized for p in params),
        biased=any(p.logit_bias for p in params),
        min_tokens=not min_tokens_reached and any(p.min_tokens > 0 for p in params),
        min_p=any(p.min_p > 0 for p in random),
        constrained=any(p.structured_output is not None for p in params),
    )


def step_sampling_mode(records: list[RowRecord]) -> SamplingMode:
    """`sampling_mode` of the rows that sample in a step, without the min_tokens mask once
    every row's reported outputs reached its min_tokens: the device's output count is never
    behind the reported one, so the mask could change nothing (host values only, no sync)."""
    reached = all(r.reported >= r.sampling.min_tokens for r in records)
    return sampling_mode([r.sampling for r in records], min_tokens_reached=reached)


class ModelRunner:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        sampler: TokenSampler,
        config: RunnerConfig,
        batch: SchedulerConfig,
        *,
        num_kv_blocks: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_scales: KVScales | None = None,
        trace_capacity: int = 1,
        distribution_exits: bool = False,
        max_speculative_rounds: int = 1,
    ) -> None:
        """README.md, "Contracts", gives the arguments; `batch` sizes the runner (rows, decode
        ticks, prompt chunks, cohorts under no_refill). `kv_scales`: the KV cache is
        float8_e4m3fn with these per-layer scales (else it has `dtype`). With
        `config.cuda_graphs`, decode ticks (and SHARED prefill waves) run as CUDA graphs; with
        `prefill_cuda_graphs` too, prompt steps up to the token budget (not for batch-invariant
        engines or whole prompts). With speculation, steps may run up to
        `max_speculative_rounds` rounds (the sampler must then be a `SpeculativeSampler`). A
        family that declares a random initial state draws it per token from its request's seed
        and position unless `initial_state` is "zero". `trace_capacity`: depths per row a trace
        exit rule holds; `distribution_exits`: the exit policy reads the next-token distribution
        every loop (the KL rules)."""
        kv_layout, block_size, max_num_seqs = config.layout, config.block_size, batch.max_num_seqs
        cohort_decoding = batch.mode is SchedulingMode.NO_REFILL
        max_decode_ticks = batch.decode_ticks_per_step
        graph_prompts = (
            config.prefill_cuda_graphs and not config.batch_invariant and not batch.whole_prompts
        )
        prefill_graph_tokens = batch.max_num_batched_tokens if graph_prompts else 0
        speculation = config.speculation if config.speculation.num_tokens else None
        if speculation is not None and speculation.draft_loops >= model.shape.num_loops:
            raise ConfigurationError(
                "speculative_draft_loops",
                f"must be below the model's depth {model.shape.num_loops} (drafting with every "
                f"loop verifies nothing), got {speculation.draft_loops}",
            )
        shape = model.shape
        self.model = model
        self.attention = attention
        self.layout = kv_layout
        self.block_size = block_size
        self.device = device
        self.max_decode_ticks = max_decode_ticks
        self.kv = KVStorage(
            num_layers=shape.num_layers,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype if kv_scales is None else FP8,
            device=device,
            scales=kv_scales,
        )
        # A speculative round's verify pass reads K positions past the last valid one (never
        # allocated: their table entries stay the scratch block).
        lookahead = speculation.num_tokens if speculation is not None else 0
        max_pages = -(-(max_model_len + lookahead) // block_size)
        stage_planes = model.family.kv.stage_planes
        self.rows = DecodeRows(
            max_rows=max_num_seqs,
            num_planes=kv_layout.storage_planes(shape.num_loops) + stage_planes,
            stage_planes=stage_planes,
            exit_distribution_width=shape.vocab_size if distribution_exits else 1,
            max_pages=max_pages,
            hidden_size=shape.state_width,
            dtype=dtype,
            device=device,
            scratch_block=self.kv.scratch_block,
            trace_capacity=trace_capacity,
            vocab_size=shape.vocab_size,
            eos_token_ids=shape.eos_token_ids,
        )
        self.pd_regions: PDRegions | None = PDRegions(self.kv, self.rows)  # what PD may register
        self.program = DecodeProgram(
            model,
            attention,
            sampler,
            self.kv,
            self.rows,
            layout=kv_layout,
            cohort=cohort_decoding,
            max_ticks=max_decode_ticks,
            random_initial_state=config.initial_state == "random",
            distribution_exits=distribution_exits,
        )
        # prompt scoring at exit depth (torch bookkeeping: chunks are not bounded like rounds)
        self.position_loops = PositionLoops(
            model, attention, self.kv, self.rows, max_position=max_model_len - 1
        )
        self.speculation: SpeculativeProgram | None = None
        if speculation is not None:
            self.speculation = SpeculativeProgram(
                model,
                attention,
                sampler,
                self.kv,
                self.rows,
                layout=kv_layout,
                cohort=cohort_decoding,
                num_drafts=speculation.num_tokens,
                draft_loops=speculation.draft_loops,
                max_slots=min(speculation.disable_batch_size or max_num_seqs, max_num_seqs),
                max_rounds=max_speculative_rounds,
                max_model_len=max_model_len,
            )
        self.snapshots = SnapshotStore()
        self.bookkeeping = StepBookkeeping(self.rows, self.kv, self.snapshots)
        self.readback_wait_s = 0.0  # cumulative host time blocked on device results
        self.graphs: DecodeGraphs | None = None
        self.shared_waves: SharedPrefillGraphs | None = None  # SHARED prefill, with graphs
        self.prefill_graphs: PrefillGraphs | None = None  # depth-major prefill, with graphs
        self.speculative_graphs: SpeculativeGraphs | None = None  # rounds, with graphs
        self._prefill_graph_limits = (prefill_graph_tokens, batch.prefill_chunk_size)
        self.graphs_disabled_reason = "not requested"
        if config.cuda_graphs:
            self._enable_graphs(max_num_seqs)

    def _enable_graphs(self, max_rows: int) -> None:
        if self.device.type != "cuda":
            self.graphs_disabled_reason = f"CUDA graphs need a CUDA device, not {self.device.type}"
        elif not self.attention.capabilities.supports_cuda_graphs:
            self.graphs_disabled_reason = (
                f"attention backend {self.attention.capabilities.name} cannot be captured"
            )
        else:
            try:
                with torch.inference_mode():
                    graphs = DecodeGraphs(self.program, max_rows=max_rows)
                    self._enable_prefill_graphs(graphs)
                    if self.speculation is not None:
                        self.speculative_graphs = SpeculativeGraphs(
                            self.speculation, pool=graphs.pool
                        )
                self.graphs = graphs
                self.graphs_disabled_reason = ""
            except (RuntimeError, ValueError) as exc:
                logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
                self.graphs_disabled_reason = f"capture failed: {exc}"

    def _enable_prefill_graphs(self, graphs: DecodeGraphs) -> None:
        """Prompts as graphs in the decode graphs' pool: SHARED waves (captured now) or
        depth-major steps (one chunk's buckets captured now, the rest on first use)."""
        tokens, chunk = self._prefill_graph_limits
        kv_plan = self.model.family.kv
        if tokens <= 0 or kv_plan.stage_layers or not kv_plan.per_loop:
            return  # prompts of stage families and of one-plane KV plans run eagerly
        if self.layout.kind is KVLayout.SHARED:
            self.shared_waves = SharedPrefillGraphs(
                self.model,
                self.attention,
                self.kv,
                self.rows,
                buckets=graphs.buckets,
                pool=graphs.pool,
            )
        else:
            self.prefill_graphs = PrefillGraphs(
                self.model,
                self.attention,
                self.kv,
                self.rows,
                self.layout,
                max_tokens=tokens,
                max_groups=graphs.max_rows,
                max_query_len=chunk,
                pool=graphs.pool,
            )
            self.prefill_graphs.capture_token_buckets()

    def persistent_bytes(self) -> int:
        """Device bytes of the runner's own buffers (rows, ring; the depth-major prefill
        graphs' inputs and output, which a runner with graphs allocates, counted even when
        this one has none: the memory profile runs eagerly), the KV pool excluded. The SHARED
        waves' buffers are a few rows: left out."""
        tensors = [*vars(self.rows).values(), *vars(self.program).values()]
        if self.speculation is not None:
            tensors += vars(self.speculation).values()
        own = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        tokens = self._prefill_graph_limits[0]
        if tokens <= 0 or self.layout.kind is KVLayout.SHARED:
            return own
        hidden = self.rows.hidden
        rows, width = hidden.shape
        return own + PrefillGraphs.buffer_bytes(tokens, rows, width, hidden.dtype)

    def close(self) -> None:
        """Drop every device buffer (graphs, KV pool, rows): the runner is unusable after."""
        self.graphs = None
        self.shared_waves = None
        self.prefill_graphs = None
        self.speculative_graphs = None
        self.speculation = None
        self.position_loops = None
        self.program = None
        self.rows = None
        self.kv = None
        self.pd_regions = None
        self.model = None
        self.snapshots = SnapshotStore()

    def held_identities(self) -> frozenset[ExecutionIdentity]:
        """Requests with device state here: a row or a preemption snapshot."""
        return frozenset(self.rows.identities()) | frozenset(self.snapshots.identities())

    # -- entry points --------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Submit and collect one step (the synchronous path)."""
        return self.collect(self.submit(step))

    def submit(self, step: SchedulerOutput) -> PendingStep:
        """Queue every device operation of `step`; returns before the device has run them."""
        pending = PendingStep(step.step_id)
        mark_step_start(pending, self.device)
        try:
            with torch.inference_mode():
                pending.failures.extend(self.bookkeeping.apply(step))
                live = self.bookkeeping.is_live
                chunks = [c for c in step.prefill if live(c.identity)]
                remote_starts = [i for i in step.remote_starts if live(i)]
                started = [
                    record
                    for record in (
                        self.rows.record(c.identity) for c in chunks if c.completes_prompt
                    )
                    if not record.prefill_only
                ] + [self.rows.record(identity) for identity in remote_starts]
                decodes = step.decode_ticks > 0 or step.speculative_rounds > 0
                running = self.rows.decoding_records() if decodes else []
                pending.mode = step_sampling_mode(running + started)
                started_record = self._run_prefill(chunks, remote_starts, started, pending)
                if step.speculative_rounds > 0:
                    self._run_rounds(step.speculative_rounds, step.decode_ticks, pending)
                    ring, counts = self.speculation.ring, self.speculation.counts
                else:
                    self._run_ticks(step.decode_ticks, pending)
                    ring, counts = self.program.ring, None
                start_readback(pending, started_record, ring, self.device, counts)
        except RECOVERABLE_ERRORS as exc:
            logger.exception("step %d failed; aborting its requests", step.step_id)
            self._fail_step(step, pending, f"{type(exc).__name__}: {exc}")
        return pending

    def _fail_step(self, step: SchedulerOutput, pending: PendingStep, message: str) -> None:
        """Name every request the step touched (still live here) and drop its device state."""
        named = [i for i in step_identities(step, self.rows) if self.bookkeeping.is_live(i)]
        self.bookkeeping.lose(named)
        pending.failures.append(ExecutionFailure(tuple(named), message, FailedOperation.STEP))
        pending.step_failed = True

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a submitted step's read-back and return its results."""
        output, waited = finish_readback(pending)
        self.readback_wait_s += waited
        return output

    # -- step parts ----------------------------------------------------------------------------
    def _run_prefill(
        self,
        chunks: list[PrefillChunk],
        remote_starts: list[ExecutionIdentity],
        started: list[RowRecord],
        pending: PendingStep,
    ) -> torch.Tensor | None:
        """Prompt chunks, then token 0 of the prompts they complete and of the PD requests whose
        prompt state was written here by a prefill instance (returns token 0's records)."""
        last_exit_depths = self._run_chunks(chunks, pending) if chunks else {}
        if not started:
            return None
        if remote_starts:  # PD decode: the prompt state a prefill instance wrote
            landed = upload(
                [self.rows.record(i).row for i in remote_starts], torch.int64, self.device
            )
            self.rows.hidden.index_copy_(0, landed, self.rows.landing[landed])
        index, lengths = upload(
            [[r.row for r in started], [r.prompt_length for r in started]],
            torch.int64,
            self.device,
        )
        pending.started = started
        depths = token0_depths(
            started, last_exit_depths, full_depth=self.model.shape.num_loops, device=self.device
        )
        record = self.program.start_rows(index, lengths, pending.mode, depths=depths)
        for r in started:
            r.decoding = True
        return record

    def _run_chunks(
        self, chunks: list[PrefillChunk], pending: PendingStep
    ) -> dict[int, torch.Tensor]:
        """Prompt chunks and their scores (prompt_chunks.py). Returns {row: exit depth (a
        device scalar)} of the prompts run at exit depth that they complete."""
        results = run_prompt_chunks(
            self.model,
            self.attention,
            self.kv,
            self.rows,
            self.layout,
            self.position_loops,
            chunks,
            graphs=self.prefill_graphs,
            shared_waves=self.shared_waves,
            state_uniforms=self.program.state_uniforms,
        )
        pending.prompt_scores.extend(results.scores)
        # Submission only: collect reports these once the step's completion is established.
        pending.queued_progress = tuple(PrefillProgress(c.identity, c.end_position) for c in chunks)
        return results.last_exit_depths

    def _run_ticks(self, ticks: int, pending: PendingStep) -> None:
        decoding = self.rows.decoding_records()
        if ticks <= 0 or not decoding:
            return
        if ticks > self.max_decode_ticks:
            raise ValueError(f"{ticks} ticks exceed the runner's ring of {self.max_decode_ticks}")
        rows = max(r.row for r in decoding) + 1
        gate = any(r.rule.exit.uses_gate for r in decoding)
        self.program.begin_step()
        if self.graphs is not None:
            rows = self.graphs.bucket(rows)
            for _ in range(ticks):
                self.graphs.tick(rows, pending.mode, gate)
        else:
            max_context = max(self.rows.allocated_tokens(r, self.block_size) for r in decoding)
            for _ in range(ticks):
                self.program.tick(rows, pending.mode, gate, max_context)
        pending.ticks = ticks
        pending.rows = rows
        pending.loop_slots = ticks * rows
        pending.owners = self.rows.row_owners(rows)

    def _run_rounds(self, rounds: int, ticks: int, pending: PendingStep) -> None:
        """Speculative rounds for every decoding row (slots in row order, padded with a row
        that does not decode: its state is left as it is)."""
        program = self.speculation
        if program is None:
            raise ValueError("a speculative step reached a runner built without speculation")
        if ticks:
            raise ValueError("a step runs decode ticks or speculative rounds, not both")
        if rounds > program.max_rounds:
            raise ValueError(f"{rounds} rounds exceed the runner's {program.max_rounds}")
        decoding = self.rows.decoding_records()
        if not decoding:
            return
        count = len(decoding)
        if count > program.max_slots:
            raise ValueError(
                f"{count} decoding rows exceed the {program.max_slots} a speculative round holds"
            )
        slots = self.speculative_graphs.bucket(count) if self.speculative_graphs else count
        gate = any(r.rule.exit.uses_gate for r in decoding)
        program.begin_step([r.row for r in decoding], slots, rounds)
        if self.speculative_graphs is not None:
            for _ in range(rounds):
                self.speculative_graphs.round(slots, pending.mode, gate)
        else:
            longest = max(self.rows.allocated_tokens(r, self.block_size) for r in decoding)
            max_context = min(longest + program.width, self.rows.max_pages * self.block_size)
            for _ in range(rounds):
                program.round(slots, pending.mode, gate, max_context)
        pending.ticks = rounds * program.width
        pending.rows = slots
        pending.speculative_rounds = rounds
        pending.drafts = program.num_drafts
        pending.loop_slots = rounds * slots * program.loops_per_round
        pending.owners = [*decoding, *[None] * (slots - count)]
