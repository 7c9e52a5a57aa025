"""`Scheduler`: owns request progression, batching and exit decisions (module M3).

The engine drives it with a feedback loop:

    output = scheduler.schedule()            # what the next step executes
    result = runner.execute(output)          # ModelRunnerOutput
    scheduler.update_from_output(result)     # progress, exits, completion
    deltas = scheduler.take_outputs()        # new tokens per request

One step holds, for every running request, at most one of: a prefill chunk (the chunk that
completes the prompt also samples token 0 and, in refill mode, starts its first loop), a coda
(sample the exited token, then start its successor's loop 1), or one recurrent loop. Decode
rows are scheduled before prefill, so prefill fills the remaining token budget; the config
guarantees that budget is never empty, so neither side starves.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from msgspec import structs
from rlt_contracts import (
    AdmissionPlan,
    CodaItem,
    DecodeLoop,
    ExecutionIdentity,
    FinishReason,
    InvalidRequestError,
    KVCopyPlan,
    ModelRunnerOutput,
    NewRequestData,
    OverloadedError,
    PrefillChunk,
    RequestBlocks,
    RequestOutputDelta,
    RequestStage,
    SamplingParams,
    SchedulerOutput,
)
from rlt_contracts.kv import KVCapacity

from rlt_scheduler.admission import NO_PREFIX, initial_allocation_tokens, plan_admission
from rlt_scheduler.config import SchedulerConfig, SchedulingMode, SchedulingPolicy
from rlt_scheduler.exit_policy import ExitPolicy, OuroExitPolicy, TraceExitPolicy
from rlt_scheduler.kv_port import KVPort, PrefixLookup
from rlt_scheduler.preemption import choose_victim
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder
from rlt_scheduler.validation import ModelLimits, validate_request
from rlt_scheduler.waiting_queue import WaitingQueue


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVPort,
        *,
        model_depth: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        exit_policy: ExitPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.model_depth = model_depth
        self.limits = ModelLimits(vocab_size, model_depth, max_model_len)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.exit_policy = exit_policy or OuroExitPolicy()
        config.check_depth(model_depth)
        self.stats = SchedulerStats()
        self._requests: dict[str, ScheduledRequest] = {}
        self._waiting = WaitingQueue(config.policy)
        self._running: list[ScheduledRequest] = []
        self._cohort: set[ExecutionIdentity] = set()  # no_refill: rows decoding together
        self._releases: list[ExecutionIdentity] = []
        self._pending_copies: list[KVCopyPlan] = []
        self._dirty: dict[str, ScheduledRequest] = {}
        self._next_generation = 0
        self._next_step = 0
        self._inflight: SchedulerOutput | None = None

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> ScheduledRequest:
        """Validate and enqueue a request. Raises InvalidRequestError / CapacityError /
        OverloadedError without changing any state."""
        prompt, bounds = validate_request(
            request_id, prompt_token_ids, sampling, self.limits, self.kv
        )
        existing = self._requests.get(request_id)
        if existing is not None and not existing.finished:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise OverloadedError(
                f"{len(self._waiting)} requests are waiting (limit "
                f"{self.config.max_waiting_requests}); retry later"
            )
        if isinstance(self.exit_policy, TraceExitPolicy):
            self.exit_policy.check_request(request_id, bounds, sampling.max_tokens)
        if sampling.seed is None:
            sampling = structs.replace(sampling, seed=secrets.randbits(63))
        request = ScheduledRequest(
            identity=ExecutionIdentity(request_id, self._next_generation),
            prompt_token_ids=prompt,
            sampling=sampling,
            bounds=bounds,
            arrival_index=self._next_generation,
        )
        self._next_generation += 1
        self._requests[request_id] = request
        self._waiting.add(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its blocks are freed at once. False if unknown."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request for a reason found outside the scheduler (e.g. a stop string)."""
        request = self._requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def running_request_ids(self) -> list[str]:
        """Ids of admitted (running) requests, in admission order."""
        return [r.identity.request_id for r in self._running]

    def pending_releases(self) -> frozenset[ExecutionIdentity]:
        """Finished or aborted requests whose runner state is dropped at the next step."""
        return frozenset(self._releases)

    def capacity(self) -> KVCapacity:
        return self.kv.capacity()

    def get_request(self, request_id: str) -> ScheduledRequest | None:
        return self._requests.get(request_id)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: decode rows first, then running prefills, then admissions.

        Any preemption decided while building the step is part of it (`snapshots`): the runner
        finishes pending KV copies, saves the victims' device state, then runs the step.
        """
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update_from_output()")
        config = self.config
        step = StepBuilder(
            config.max_num_batched_tokens, config.max_num_batched_token_loops, self.model_depth
        )
        self._preempt_for_priority(step)
        if config.mode is SchedulingMode.REFILL:
            self._schedule_refill_decode(step)
        else:
            self._schedule_cohort_decode(step)
        for request in list(self._running):
            if (
                request.stage is RequestStage.PREFILL
                and request in self._running
                and step.prefill_room() > 0
            ):
                self._schedule_prefill_chunk(request, step)
        self._admit(step)
        step.kv_copies.extend(self._pending_copies)
        self._pending_copies.clear()
        compute_gates = any(
            self.exit_policy.needs_gate(self._requests[item.identity.request_id].bounds)
            for item in step.decode
        )
        output = step.build(
            self._next_step, released=tuple(self._releases), compute_gates=compute_gates
        )
        self._releases.clear()
        self._next_step += 1
        self._inflight = output
        return output

    def _schedule_refill_decode(self, step: StepBuilder) -> None:
        for request in list(self._running):
            if request not in self._running:
                continue  # preempted while this step was being built
            if request.stage is RequestStage.CODA:
                self._schedule_coda(request, step, continue_token=request.wants_continuation())
            elif request.stage is RequestStage.RECURRENT:
                self._schedule_loop(request, step)
            elif request.stage is RequestStage.PRELUDE:
                self._schedule_first_loop(request, step)

    def _schedule_cohort_decode(self, step: StepBuilder) -> None:
        """no_refill: loop the cohort until every member exited, then sample all of them and
        start the next cohort (their successors plus requests waiting in PRELUDE)."""
        cohort_looping = [
            r
            for r in self._running
            if r.identity in self._cohort and r.stage is RequestStage.RECURRENT
        ]
        if cohort_looping:
            for request in cohort_looping:
                self._schedule_loop(request, step)
            return
        self._cohort.clear()
        for request in list(self._running):
            if request not in self._running:
                continue
            if request.stage is RequestStage.CODA:
                if self._schedule_coda(request, step, continue_token=request.wants_continuation()):
                    self._cohort.add(request.identity)
            elif request.stage is RequestStage.PRELUDE:
                if self._schedule_first_loop(request, step):
                    self._cohort.add(request.identity)

    def _schedule_coda(
        self, request: ScheduledRequest, step: StepBuilder, *, continue_token: bool
    ) -> bool:
        """Coda, plus the successor's loop 1 when KV for its position is available.
        Returns whether the successor started."""
        step.add_coda(
            CodaItem(
                request.identity,
                position=request.looping_position,
                output_index=request.num_outputs,
                exit_depth=request.exit_depth,
            )
        )
        next_position = request.looping_position + 1
        if continue_token and self._ensure_kv(request, next_position + 1, step):
            step.add_decode(DecodeLoop(request.identity, next_position, 1, starts_token=True))
            return True
        return False

    def _schedule_loop(self, request: ScheduledRequest, step: StepBuilder) -> None:
        step.add_decode(
            DecodeLoop(
                request.identity,
                request.looping_position,
                request.loops_done + 1,
                starts_token=False,
            )
        )

    def _schedule_first_loop(self, request: ScheduledRequest, step: StepBuilder) -> bool:
        if not self._ensure_kv(request, request.looping_position + 1, step):
            return False
        step.add_decode(
            DecodeLoop(request.identity, request.looping_position, 1, starts_token=True)
        )
        return True

    def _schedule_prefill_chunk(self, request: ScheduledRequest, step: StepBuilder) -> None:
        start = request.computed_prompt_tokens
        count = min(
            step.prefill_room(), self.config.prefill_chunk_size, request.prompt_length - start
        )
        if count <= 0 or not self._ensure_kv(request, start + count, step):
            return
        completes = start + count == request.prompt_length
        step.add_prefill(
            PrefillChunk(
                request.identity,
                start_position=start,
                token_ids=request.prompt_token_ids[start : start + count],
                completes_prompt=completes,
            )
        )
        if not completes:
            return
        # The last prompt position goes straight to coda: token 0 at full depth.
        step.add_coda(CodaItem(request.identity, request.prompt_length - 1, 0, self.model_depth))
        if (
            self.config.mode is SchedulingMode.REFILL
            and request.sampling.max_tokens > 1
            and step.token_budget > 0
            and (step.loop_budget is None or step.loop_budget > 0)
            and self._ensure_kv(request, request.prompt_length + 1, step)
        ):
            step.add_decode(
                DecodeLoop(request.identity, request.prompt_length, 1, starts_token=True)
            )

    # -- KV growth and preemption ---------------------------------------------------------------
    def _ensure_kv(self, request: ScheduledRequest, num_tokens: int, step: StepBuilder) -> bool:
        """Make the request's blocks cover positions [0, num_tokens), preempting another request
        once if that is allowed and needed. False: not possible this step (nothing changed)."""
        updates = self.kv.grow(request.identity, num_tokens)
        if updates is None and self.config.enable_preemption:
            victim = choose_victim(
                self._running,
                excluded=step.selected | {request.identity},
                held_blocks=self.kv.held_blocks,
            )
            if victim is not None:
                self._preempt(victim, step)
                updates = self.kv.grow(request.identity, num_tokens)
        if updates is None:
            return False
        if updates:
            step.block_updates.append(RequestBlocks(request.identity, updates))
        return True

    def _preempt(self, victim: ScheduledRequest, step: StepBuilder) -> None:
        """Suspend `victim`: the runner snapshots its device state first thing in this step; its
        blocks are free for the rest of the step; it waits to be resumed exactly where it was."""
        step.snapshots.append(victim.identity)
        victim.snapshot_tokens = self.kv.allocated_tokens(victim.identity)
        victim.resume_stage = victim.stage
        self.kv.free(victim.identity)
        self._running.remove(victim)
        self._cohort.discard(victim.identity)
        victim.stage = RequestStage.WAITING
        self._waiting.add(victim)
        self.stats.preemptions += 1

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, step: StepBuilder) -> None:
        """Admit waiting requests in policy order with bounded bypass.

        A request that does not fit is deferred and later ones may pass it, but at most
        `admission_scan_limit` are examined, and once a deferred request has been passed
        `max_admission_bypasses` times nobody passes it any more (no starvation).
        """
        deferred: list[ScheduledRequest] = []
        for scanned, request in enumerate(self._waiting):
            if scanned >= self.config.admission_scan_limit or step.prefill_room() <= 0:
                return
            if len(self._running) >= self.config.max_num_seqs:
                return
            if self._try_admit(request, step):
                for waiting in deferred:
                    waiting.bypass_count += 1
                if any(w.bypass_count >= self.config.max_admission_bypasses for w in deferred):
                    return
            elif request.bypass_count >= self.config.max_admission_bypasses:
                return  # protected: it is next, whatever fits behind it
            else:
                deferred.append(request)

    def _preempt_for_priority(self, step: StepBuilder) -> None:
        """Before any row is selected: if the best waiting request cannot be admitted (no slot
        or not enough KV) and strictly lower-priority requests run, suspend them (worst first)
        until it can. Only the head of the queue may preempt, so one step preempts for at most
        one arrival."""
        if not (self.config.enable_preemption and self.config.policy is SchedulingPolicy.PRIORITY):
            return
        head = next(iter(self._waiting), None)
        if head is None:
            return
        prefix = self.kv.match_prefix(head.prompt_token_ids) if not head.preempted else NO_PREFIX
        while len(self._running) >= self.config.max_num_seqs or not self.plan_admission(
            head, prefix
        ).fits(self.kv.capacity().free_blocks):
            victim = self._priority_victim(head, step)
            if victim is None:
                return
            self._preempt(victim, step)

    def _priority_victim(
        self, request: ScheduledRequest, step: StepBuilder
    ) -> ScheduledRequest | None:
        if not (self.config.enable_preemption and self.config.policy is SchedulingPolicy.PRIORITY):
            return None
        return choose_victim(
            self._running,
            excluded=step.selected,
            held_blocks=self.kv.held_blocks,
            worse_than_priority=request.sampling.priority,
        )

    def plan_admission(self, request: ScheduledRequest, prefix: PrefixLookup) -> AdmissionPlan:
        """The block budget of admitting `request` now (see admission.plan_admission)."""
        return plan_admission(self.config, self.kv, request, prefix, self._running)

    def _try_admit(self, request: ScheduledRequest, step: StepBuilder) -> bool:
        prefix = (
            self.kv.match_prefix(request.prompt_token_ids) if not request.preempted else NO_PREFIX
        )
        if not self.plan_admission(request, prefix).fits(self.kv.capacity().free_blocks):
            return False
        if request.preempted:
            return self._resume(request, step)
        initial_tokens = initial_allocation_tokens(self.config, request, prefix)
        updates = self.kv.allocate(
            request.identity, initial_tokens, prefix, prompt_length=request.prompt_length
        )
        if updates is None:
            return False
        self._waiting.remove(request)
        self._running.append(request)
        request.stage = RequestStage.PREFILL
        request.computed_prompt_tokens = prefix.num_tokens
        request.known_to_runner = True
        step.new_requests.append(
            NewRequestData(request.identity, request.sampling, request.prompt_length)
        )
        step.block_updates.append(RequestBlocks(request.identity, updates))
        self._schedule_prefill_chunk(request, step)
        return True

    def _resume(self, request: ScheduledRequest, step: StepBuilder) -> bool:
        """Give a preempted request blocks covering its snapshot; the runner restores it
        before this step's work. It continues from the same stage, loop and exit state."""
        updates = self.kv.allocate(request.identity, request.snapshot_tokens, NO_PREFIX)
        if updates is None:
            return False
        self._waiting.remove(request)
        self._running.append(request)
        request.stage = request.resume_stage
        request.snapshot_tokens = request.resume_stage = None
        if self.config.mode is SchedulingMode.NO_REFILL and request.stage is RequestStage.RECURRENT:
            self._cohort.add(request.identity)
        step.block_updates.append(RequestBlocks(request.identity, updates))
        step.restores.append(request.identity)
        self.stats.resumptions += 1
        return True

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, result: ModelRunnerOutput) -> None:
        """Apply one step's results: prompt progress, sampled tokens, then loop/exit progress."""
        step = self._inflight
        if step is None or result.step_id != step.step_id:
            raise RuntimeError(f"result of step {result.step_id} does not match the step in flight")
        self._inflight = None
        self.stats.steps += 1
        if result.failure is not None:
            for identity in result.failure.identities:
                request = self._current(identity)
                if request is not None:
                    self._finish(request, FinishReason.ABORT, error=result.failure.message)
        for progress in result.prefill_progress:
            request = self._current(progress.identity)
            if request is not None:
                self.stats.prompt_tokens += progress.end_position - request.computed_prompt_tokens
                request.computed_prompt_tokens = progress.end_position
                self.kv.publish_prefix(
                    request.identity, request.prompt_token_ids, progress.end_position
                )
        coda_depths = {item.identity: item.exit_depth for item in step.coda}
        continued = {item.identity for item in step.decode if item.starts_token}
        for sampled in result.sampled_tokens:
            request = self._current(sampled.identity)
            if request is not None:
                self._record_token(request, sampled, coda_depths[sampled.identity], continued)
        gates = {signal.identity: signal.exit_probability for signal in result.gate_signals}
        for item in step.decode:
            request = self._current(item.identity)
            if request is not None and request.stage is not RequestStage.FINISHED:
                self._apply_loop(request, item, gates.get(item.identity))

    def _record_token(self, request, sampled, exit_depth: int, continued: set) -> None:
        request.output_token_ids.append(sampled.token_id)
        request.exit_depths.append(exit_depth)
        if sampled.logprob is not None:
            request.logprobs.append(sampled.logprob)
            request.top_logprobs.append(sampled.top_logprobs)
        self.stats.generation_tokens += 1
        if sampled.output_index > 0:
            self.stats.decode_loops += exit_depth
        self._dirty[request.identity.request_id] = request
        reason = self._finish_reason(request, sampled.token_id)
        if reason is not None:
            self._finish(request, reason)
        elif request.identity in continued:
            request.stage = RequestStage.RECURRENT  # its successor ran loop 1 in this step
        else:
            request.stage = RequestStage.PRELUDE

    def _finish_reason(self, request: ScheduledRequest, token_id: int) -> FinishReason | None:
        if token_id in request.sampling.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.eos_token_ids and not request.sampling.ignore_eos:
            return FinishReason.STOP
        if request.num_outputs >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def _apply_loop(self, request: ScheduledRequest, item: DecodeLoop, exit_probability) -> None:
        if item.starts_token:
            request.start_token()
        request.loops_done = item.loop_index
        exits = self.exit_policy.after_loop(
            request.exit_state,
            request.bounds,
            item.loop_index,
            exit_probability,
            request_id=request.identity.request_id,
            output_index=request.num_outputs,
        )
        if not exits:
            request.stage = RequestStage.RECURRENT
            return
        request.stage = RequestStage.CODA
        request.exit_depth = item.loop_index
        if self.kv.num_planes > 1 and item.loop_index < self.model_depth:
            self._pending_copies.append(
                KVCopyPlan(
                    request.identity,
                    position=item.position,
                    source_plane=item.loop_index - 1,
                    target_planes=tuple(range(item.loop_index, self.model_depth)),
                )
            )

    # -- completion and outputs ----------------------------------------------------------------
    def _current(self, identity: ExecutionIdentity) -> ScheduledRequest | None:
        """The live request with this identity; None for results of cancelled/replaced ones."""
        request = self._requests.get(identity.request_id)
        if request is None or request.identity != identity or request.finished:
            return None
        return request

    def _finish(
        self, request: ScheduledRequest, reason: FinishReason, *, error: str | None = None
    ) -> None:
        """The one cleanup path of completion, abort and failure (R16)."""
        if request.stage is RequestStage.WAITING:
            self._waiting.remove(request)  # new, or preempted (its snapshot is dropped below)
        else:
            self._running.remove(request)
        request.stage = RequestStage.FINISHED
        request.finish_reason = reason
        request.error = error
        self.kv.free(request.identity)
        self._cohort.discard(request.identity)
        self._pending_copies = [c for c in self._pending_copies if c.identity != request.identity]
        if request.known_to_runner:
            self._releases.append(request.identity)
        if reason is FinishReason.ABORT:
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1
        self._dirty[request.identity.request_id] = request

    def take_outputs(self) -> list[RequestOutputDelta]:
        """Deltas of every request with new tokens or a new finish since the last call.

        Finished requests are forgotten once reported, so their id may be reused.
        """
        deltas = []
        for request_id, request in self._dirty.items():
            deltas.append(request.take_delta())
            if request.finished and self._requests.get(request_id) is request:
                del self._requests[request_id]
        self._dirty.clear()
        return deltas
