"""`ModelRunner`: executes one `SchedulerOutput` on the device and reports `ModelRunnerOutput`.

Order inside a step (the contract in rlt_contracts.scheduling): bookkeeping (releases, new
requests, block tables), prefill at full depth, LAST_EXITED finalization copies, coda (LM head +
sampling; tokens stay on the device), then one recurrent loop for every decode row, embedding
freshly sampled tokens first. Host reads happen once per step, after all device work is queued:
gate probabilities and sampled tokens (R21).
"""

from __future__ import annotations

import logging
import time

import torch
from rlt_contracts import (
    AttentionBackend,
    CodaItem,
    DecodeLoop,
    ExecutionFailure,
    GateSignal,
    KVCopyPlan,
    KVLayout,
    LoopedLanguageModel,
    ModelRunnerOutput,
    PrefillChunk,
    PrefillProgress,
    SampledToken,
    SamplingRow,
    SchedulerOutput,
    TokenSampler,
)

from rlt_runner.attention_batches import decode_batch, prefill_batch
from rlt_runner.decode_graphs import DecodeGraphs
from rlt_runner.kv_storage import KVStorage
from rlt_runner.request_slots import RequestSlots
from rlt_runner.snapshots import SnapshotStore

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LoopedLanguageModel,
        attention: AttentionBackend,
        sampler: TokenSampler,
        *,
        kv_layout: KVLayout,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool = False,
    ) -> None:
        shape = model.shape
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.layout = kv_layout
        self.depth = shape.num_loops
        self.block_size = block_size
        self.device = device
        self.kv = KVStorage(
            num_layers=shape.num_layers,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            device=device,
        )
        self.slots = RequestSlots(
            max_requests=max_num_seqs,
            num_planes=kv_layout.storage_planes(shape.num_loops),
            max_pages=-(-max_model_len // block_size),
            hidden_size=shape.hidden_size,
            dtype=dtype,
            device=device,
        )
        self.snapshots = SnapshotStore()
        self.readback_wait_s = 0.0  # cumulative host time blocked on device results
        self.graphs: DecodeGraphs | None = None
        self.graphs_disabled_reason = "not requested"
        if cuda_graphs:
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
                    self.graphs = DecodeGraphs(
                        self.model,
                        self.attention,
                        self.kv,
                        self.slots,
                        max_rows=max_rows,
                        device=self.device,
                    )
                self.graphs_disabled_reason = ""
            except (RuntimeError, ValueError) as exc:
                logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
                self.graphs_disabled_reason = f"capture failed: {exc}"

    def held_identities(self) -> frozenset:
        """Requests with device state here: a runner slot or a preemption snapshot."""
        return frozenset(self.slots.identities()) | frozenset(self.snapshots.identities())

    # -- entry point ---------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        with torch.inference_mode():
            self._apply_bookkeeping(step)
        if not step.has_work:
            return ModelRunnerOutput(step_id=step.step_id)
        try:
            with torch.inference_mode():
                self._run_prefill(step.prefill)
                sampled = self._run_coda(step.coda)
                exit_probs = self._run_decode(step.decode, step.compute_gates)
                return self._collect(step, sampled, exit_probs)
        except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as exc:
            logger.exception("step %d failed; aborting its requests", step.step_id)
            identities = {item.identity for item in (*step.prefill, *step.coda, *step.decode)}
            return ModelRunnerOutput(
                step_id=step.step_id,
                failure=ExecutionFailure(tuple(identities), f"{type(exc).__name__}: {exc}"),
            )

    def _apply_bookkeeping(self, step: SchedulerOutput) -> None:
        """State changes that precede the step's model work, in the contract's order: pending
        finalization copies (victims included, on blocks they still hold on the device),
        snapshots of preempted requests, releases, then new and restored requests get slots
        and block tables and the restored ones their saved state."""
        self._run_kv_copies(step.kv_copies)
        for identity in step.snapshots:
            self.snapshots.save(identity, self.slots, self.kv)
        for identity in step.released:
            self.slots.release(identity)
            self.snapshots.discard(identity)
        for new in step.new_requests:
            self.slots.assign(new.identity, new.sampling)
        for identity in step.restores:
            self.slots.assign(identity, self.snapshots.sampling_of(identity))
        for blocks in step.block_updates:
            self.slots.apply_block_updates(blocks.identity, blocks.updates)
        for identity in step.restores:
            self.snapshots.restore(identity, self.slots, self.kv)

    # -- prefill -------------------------------------------------------------------------------
    def _run_prefill(self, chunks: tuple[PrefillChunk, ...]) -> None:
        """Prompt chunks at full depth; completed prompts leave their final state in `hidden`."""
        if not chunks:
            return
        if self.layout is KVLayout.SHARED:
            self._prefill_position_by_position(chunks)
        else:
            self._prefill_depth_major(chunks)

    def _prefill_depth_major(self, chunks: tuple[PrefillChunk, ...]) -> None:
        """LAST_EXITED: every chunk position runs loop 1 (plane 0), then loop 2, and so on.
        A position at loop t reads plane t of earlier positions, all at full depth."""
        slot_ids = [self.slots.state(c.identity).slot for c in chunks]
        starts = [c.start_position for c in chunks]
        lengths = [len(c.token_ids) for c in chunks]
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        positions = torch.cat([torch.arange(c.start_position, c.end_position) for c in chunks]).to(
            self.device
        )
        hidden = self.model.embed(token_ids)
        for loop in range(1, self.depth + 1):
            batch = prefill_batch(
                self.slots,
                slot_ids,
                self.layout.plane_of_loop(loop),
                starts,
                lengths,
                block_size=self.block_size,
                device=self.device,
            )
            attention = self.attention.bind(self.kv.tensors, batch)
            hidden, _ = self.model.recurrent_step(hidden, positions, attention, compute_gate=False)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        done = [i for i, c in enumerate(chunks) if c.completes_prompt]
        if done:
            index = torch.tensor(done, device=self.device)
            self.slots.hidden[torch.tensor(slot_ids, device=self.device)[index]] = hidden[
                ends[index]
            ]

    def _prefill_position_by_position(self, chunks: tuple[PrefillChunk, ...]) -> None:
        """SHARED: each request advances one prompt position at a time through all loops
        (batched across requests), so every prompt token sees earlier prompt tokens at their
        final depth whatever the chunk boundaries are."""
        for offset in range(max(len(c.token_ids) for c in chunks)):
            wave = [c for c in chunks if offset < len(c.token_ids)]
            slot_ids = [self.slots.state(c.identity).slot for c in wave]
            positions_host = [c.start_position + offset for c in wave]
            positions = torch.tensor(positions_host, device=self.device)
            hidden = self.model.embed(
                torch.tensor([c.token_ids[offset] for c in wave], device=self.device)
            )
            for _ in range(self.depth):
                batch = prefill_batch(
                    self.slots,
                    slot_ids,
                    0,
                    positions_host,
                    [1] * len(wave),
                    block_size=self.block_size,
                    device=self.device,
                )
                attention = self.attention.bind(self.kv.tensors, batch)
                hidden, _ = self.model.recurrent_step(
                    hidden, positions, attention, compute_gate=False
                )
            done = [
                i
                for i, c in enumerate(wave)
                if c.completes_prompt and offset == len(c.token_ids) - 1
            ]
            if done:
                index = torch.tensor(done, device=self.device)
                self.slots.hidden[torch.tensor(slot_ids, device=self.device)[index]] = hidden[index]

    # -- finalization, coda, decode -------------------------------------------------------------
    def _run_kv_copies(self, plans: tuple[KVCopyPlan, ...]) -> None:
        """LAST_EXITED early exit: copy the token's exit-depth KV into the skipped planes."""
        if not plans:
            return
        sources, targets = [], []
        for plan in plans:
            source = self.slots.slot_of_position(
                plan.identity, plan.source_plane, plan.position, self.block_size
            )
            for plane in plan.target_planes:
                sources.append(source)
                targets.append(
                    self.slots.slot_of_position(
                        plan.identity, plane, plan.position, self.block_size
                    )
                )
        self.kv.copy_slots(
            torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device)
        )

    def _run_coda(self, items: tuple[CodaItem, ...]):
        """LM head on the exited states, sampling; tokens become the rows' pending tokens."""
        if not items:
            return None
        slot_ids = torch.tensor(
            [self.slots.state(i.identity).slot for i in items], device=self.device
        )
        logits = self.model.coda(self.slots.hidden[slot_ids])
        rows = [SamplingRow(self.slots.state(i.identity).sampling, i.output_index) for i in items]
        sampled = self.sampler.sample(logits, rows)
        self.slots.pending_token[slot_ids] = sampled.token_ids
        return sampled

    def _run_decode(self, items: tuple[DecodeLoop, ...], compute_gates: bool):
        if not items:
            return None
        columns = torch.tensor(
            [
                [self.slots.state(i.identity).slot for i in items],
                [self.layout.plane_of_loop(i.loop_index) for i in items],
                [i.position for i in items],
                [int(i.starts_token) for i in items],
            ],
            device=self.device,
        )
        slot_ids, planes, positions, starts = columns.unbind(0)
        hidden = self.slots.hidden[slot_ids]
        if any(i.starts_token for i in items):
            embedded = self.model.embed(self.slots.pending_token[slot_ids])
            hidden = torch.where(starts.bool()[:, None], embedded, hidden)
        if self.graphs is not None and len(items) <= self.graphs.max_rows:
            hidden, exit_probs = self.graphs.run(hidden, slot_ids, planes, positions)
            self.slots.hidden[slot_ids] = hidden
            return exit_probs.clone() if compute_gates else None
        batch = decode_batch(
            self.slots,
            slot_ids,
            planes,
            positions,
            block_size=self.block_size,
            max_position=max(i.position for i in items),
        )
        attention = self.attention.bind(self.kv.tensors, batch)
        hidden, exit_probs = self.model.recurrent_step(
            hidden, positions, attention, compute_gate=compute_gates
        )
        self.slots.hidden[slot_ids] = hidden
        return exit_probs

    # -- results -------------------------------------------------------------------------------
    def _collect(self, step: SchedulerOutput, sampled, exit_probs) -> ModelRunnerOutput:
        start = time.perf_counter()
        probs = exit_probs.tolist() if exit_probs is not None else []
        host = sampled.to_host() if sampled is not None else []
        self.readback_wait_s += time.perf_counter() - start
        tokens = tuple(
            SampledToken(item.identity, item.output_index, token, logprob, top)
            for item, (token, logprob, top) in zip(step.coda, host, strict=True)
        )
        gates = tuple(
            GateSignal(item.identity, item.position, item.loop_index, p)
            for item, p in zip(step.decode, probs, strict=False)
        )
        progress = tuple(PrefillProgress(c.identity, c.end_position) for c in step.prefill)
        return ModelRunnerOutput(
            step_id=step.step_id,
            gate_signals=gates,
            sampled_tokens=tokens,
            prefill_progress=progress,
        )
