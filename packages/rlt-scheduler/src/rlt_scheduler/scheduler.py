"""`Scheduler`: owns request progression, batching and exit policy (module M3).

The engine drives it with a feedback loop that may run one step ahead of the device:

    output = scheduler.schedule()            # what the next step executes
    ...runner submits it; the previous step completes...
    scheduler.update_from_output(result)     # results of the oldest submitted step
    deltas = scheduler.take_outputs()        # new tokens per request

Steps are applied in submission order. Between schedule() of step n and update_from_output()
of step n, later steps may be scheduled: prompt chunks advance optimistically (they are
deterministic), decoding rows keep running on the device, and every decoding request's blocks
cover the most outputs the submitted steps can produce (`unconfirmed_tokens`, `in_flight.py`).

A step holds prefill chunks under the token budget and `decode_ticks` loop ticks for every
decoding request. While prompts are waiting to be computed a step runs one tick, so prefill is
never held up; otherwise several ticks (up to `decode_ticks_per_step`, and in refill mode no
more than the longest request can still use) run per host round trip.

This module owns the queues and the request table, decides the step-building order and
admission, and keeps the one cleanup path (`_finish`). It composes: `intake.py` (waiting room,
request state), `admission.py` (budgets, first admission), `suspension.py` (KV growth,
preemption and resumption), `constrained.py` (structured-output masks), `siblings.py` (a
sibling group computes its prompt once), `pd_stages.py` (PD handoff stages and held blocks),
`in_flight.py` (steps not yet applied) and `outputs.py` (applying prompt progress and tokens).

Each request records when it was queued (add_request), first admitted (schedule) and when the
results holding its first and latest tokens were applied (update_from_output), on the host's
time.monotonic() clock; its final delta reports them (`RequestTimings`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rlt_contracts import (
    NO_PREFIX,
    AdmissionPlan,
    EngineRequest,
    ExecutionIdentity,
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    KVPort,
    KVTransferParams,
    ModelRunnerOutput,
    PrefillChunk,
    PrefixMatch,
    RequestOutputDelta,
    RequestStage,
    SamplingParams,
    SchedulerOutput,
    TokenConstraint,
)
from rlt_contracts.kv import KVCapacity
from rlt_contracts.structured import ConstraintCompiler

from rlt_scheduler import constrained, outputs, pd_stages, siblings, suspension
from rlt_scheduler.admission import initial_allocation_tokens, plan_admission, start_admitted
from rlt_scheduler.config import SchedulerConfig, SchedulingPolicy
from rlt_scheduler.exit_policy import ExitPolicy, LoopBounds, OuroExitPolicy
from rlt_scheduler.in_flight import StepsInFlight, SubmittedStep
from rlt_scheduler.intake import build_scheduled_request, check_waiting_room
from rlt_scheduler.pd_stages import PDHandoffs
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder
from rlt_scheduler.tick_policy import decode_ticks
from rlt_scheduler.validation import ModelLimits, check_kv_transfer, validate_request
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
        prefix_caching: bool = False,
        constraint_compiler: ConstraintCompiler | None = None,
    ) -> None:
        """`prefix_caching`: `kv` publishes computed prompt pages for reuse (the engine passes
        its KV manager's setting); only then do siblings wait for one another's prompt.
        `constraint_compiler`: builds the matchers of structured-output requests (None: such
        requests are rejected)."""
        self.config = config
        self.constraint_compiler = constraint_compiler
        self.prefix_caching = prefix_caching
        self.kv = kv
        self.model_depth = model_depth
        self.limits = ModelLimits(vocab_size, model_depth, max_model_len)
        self.eos_token_ids = tuple(eos_token_ids)
        self.exit_policy = exit_policy or OuroExitPolicy()
        config.check_depth(model_depth)
        self.stats = SchedulerStats()
        self._requests: dict[str, ScheduledRequest] = {}
        self._waiting = WaitingQueue(config.policy)
        self._running: list[ScheduledRequest] = []
        self._releases: list[ExecutionIdentity] = []
        self._dirty: dict[str, ScheduledRequest] = {}
        self._in_flight = StepsInFlight()
        self._handoffs = PDHandoffs()  # PD: held blocks, decode requests awaiting their KV
        self._next_generation = 0
        self._next_step = 0
        # requests queued since step `_fresh_step` was scheduled (no admission saw them yet)
        self._fresh: list[ScheduledRequest] = []
        self._fresh_step = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        kv_transfer: KVTransferParams | None = None,
    ) -> ScheduledRequest:
        """Validate and enqueue a request. Raises InvalidRequestError / CapacityError /
        OverloadedError without changing any state. `kv_transfer` (PD): role DECODE admits the
        request to wait for its prompt's KV from a prefill instance; role PREFILL computes the
        prompt only, for transfer to `kv_transfer.target`."""
        [request] = self.add_requests(
            [EngineRequest(request_id, tuple(prompt_token_ids), sampling, kv_transfer=kv_transfer)]
        )
        return request

    def add_requests(self, requests: Sequence[EngineRequest]) -> list[ScheduledRequest]:
        """Validate and enqueue several requests, all or none: every one is checked (as in
        `add_request`) and the waiting queue must have room for all of them before any is
        queued; otherwise the first error is raised and nothing changed."""
        checked = [self._check_new_request(r) for r in requests]
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise InvalidRequestError("request_id", f"{duplicate!r} is given more than once")
        self._check_waiting_room(len(requests))
        return [self._enqueue(request, *c) for request, c in zip(requests, checked, strict=True)]

    def _check_new_request(
        self, request: EngineRequest
    ) -> tuple[tuple[int, ...], LoopBounds, TokenConstraint | None]:
        prompt, bounds = validate_request(
            request.request_id, request.prompt_token_ids, request.sampling, self.limits, self.kv
        )
        check_kv_transfer(request.kv_transfer, len(prompt))
        existing = self._requests.get(request.request_id)
        if existing is not None and not existing.finished:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self.exit_policy.check_request(request.request_id, bounds, request.sampling.max_tokens)
        return prompt, bounds, constrained.compile_constraint(request, self.constraint_compiler)

    def _check_waiting_room(self, count: int) -> None:
        """Raise unless `count` more requests fit the waiting room (`intake.check_waiting_room`:
        requests queued since the last step count only beyond the runner slots free now)."""
        if self._fresh_step != self._next_step:  # a step ran: every queued request was seen
            self._fresh, self._fresh_step = [], self._next_step
        check_waiting_room(
            self.config,
            count=count,
            queued=len(self._waiting),
            fresh_waiting=sum(1 for r in self._fresh if r.stage is RequestStage.WAITING),
            running=len(self._running),
            held=self._handoffs.num_held,
        )

    def _enqueue(
        self,
        new: EngineRequest,
        prompt: tuple[int, ...],
        bounds: LoopBounds,
        constraint: TokenConstraint | None,
    ) -> ScheduledRequest:
        request = build_scheduled_request(
            new,
            prompt,
            bounds,
            constraint,
            generation=self._next_generation,
            exit_policy=self.exit_policy,
            eos_token_ids=self.eos_token_ids,
            queued_time=time.monotonic(),
        )
        self._next_generation += 1
        self._requests[new.request_id] = request
        self._waiting.add(request)
        self._fresh.append(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its blocks are freed at once (device work already
        submitted is ordered before any later use of them). False if unknown."""
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
        return bool(self._waiting or self._running or self._handoffs.num_held)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_submitted_steps(self) -> int:
        """Steps scheduled whose results were not applied yet."""
        return len(self._in_flight)

    def running_request_ids(self) -> list[str]:
        """Ids of admitted (running) requests, in admission order."""
        return [r.identity.request_id for r in self._running]

    def waiting_request_ids(self) -> list[str]:
        """Ids of waiting (new or preempted) requests, in queue order."""
        return [r.identity.request_id for r in self._waiting]

    def pending_releases(self) -> frozenset[ExecutionIdentity]:
        """Finished or aborted requests whose runner state is dropped at the next step."""
        return frozenset(self._releases)

    def capacity(self) -> KVCapacity:
        return self.kv.capacity()

    def get_request(self, request_id: str) -> ScheduledRequest | None:
        return self._requests.get(request_id)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: decoding rows first, then running prefills, then admissions.

        Any preemption decided while building the step is part of it (`snapshots`): the runner
        saves the victims' device state first thing in this step.
        """
        config = self.config
        step = StepBuilder(
            config.max_num_batched_tokens, config.max_num_batched_token_loops, self.model_depth
        )
        self._preempt_for_priority(step)
        ticks = decode_ticks(
            config,
            self._running,
            len(self._running),
            len(self._waiting),
            self._in_flight.unconfirmed_ticks,
        )
        for request in [r for r in self._running if r.stage is RequestStage.DECODING]:
            if request in self._running:  # not preempted while this step was being built
                self._schedule_decode(request, ticks, step)
        for request in [r for r in self._running if r.stage is RequestStage.PREFILL]:
            if request in self._running and step.prefill_room() > 0:
                self._schedule_prefill_chunk(request, ticks, step)
        for request in [r for r in self._running if r.stage is RequestStage.AWAITING_KV]:
            if request.kv_landed:
                self._schedule_remote_start(request, ticks, step)
        self._admit(ticks, step)
        decoding = self._looping_rows(step)
        if not decoding:  # no decoding row and no request starting to decode: no ticks
            ticks = 0
        output = step.build(self._next_step, released=tuple(self._releases), decode_ticks=ticks)
        self._releases.clear()
        self._next_step += 1
        self._in_flight.submit(
            SubmittedStep(output, step.output_bounds, decoding), self._request_of
        )
        for identity in decoding:
            constrained.count_mask_ticks(self._request_of(identity), ticks)
        return output

    def _looping_rows(self, step: StepBuilder) -> frozenset[ExecutionIdentity]:
        """Requests that loop in the step's ticks: decoding rows, PD remote starts and
        completing chunks that sample token 0 (not on a PD prefill instance)."""
        return (
            frozenset(step.decoding)
            | frozenset(step.remote_starts)
            | frozenset(
                c.identity
                for c in step.prefill
                if c.completes_prompt and not self._requests[c.identity.request_id].prefill_only
            )
        )

    def _request_of(self, identity: ExecutionIdentity) -> ScheduledRequest:
        """The request a step being scheduled holds (it is in `_requests` by construction)."""
        return self._requests[identity.request_id]

    def _schedule_decode(self, request: ScheduledRequest, ticks: int, step: StepBuilder) -> None:
        bound = constrained.decode_output_bound(request, ticks)
        most_outputs = request.num_outputs + request.unconfirmed_tokens + bound
        if self._ensure_kv(request, request.kv_tokens_needed(most_outputs), step, may_suspend=True):
            step.add_decode(request.identity, bound)
            constrained.send_mask_if_due(request, step)

    def _schedule_prefill_chunk(
        self, request: ScheduledRequest, ticks: int, step: StepBuilder
    ) -> None:
        start = request.scheduled_prompt_tokens
        count = min(
            step.prefill_room(), self.config.prefill_chunk_size, request.prompt_length - start
        )
        if count <= 0:
            return
        completes = start + count == request.prompt_length
        # A completing chunk samples token 0, and its successor may loop in this step's ticks
        # (not on a PD prefill instance: the state is sent for the decode instance's coda).
        starts = completes and not request.prefill_only
        bound = constrained.start_output_bound(request, ticks) if starts else 0
        needed = max(start + count, request.kv_tokens_needed(bound)) if starts else start + count
        if not self._ensure_kv(request, needed, step, may_suspend=False):
            return
        step.add_prefill(
            PrefillChunk(
                request.identity,
                start_position=start,
                token_ids=request.prompt_token_ids[start : start + count],
                completes_prompt=completes,
            ),
            bound,
        )
        request.scheduled_prompt_tokens = start + count
        if completes:
            request.stage = (
                RequestStage.SENDING_KV if request.prefill_only else RequestStage.DECODING
            )
        if starts:
            constrained.send_token0_mask(request, step)

    def _schedule_remote_start(
        self, request: ScheduledRequest, ticks: int, step: StepBuilder
    ) -> None:
        """PD decode: the prompt's KV landed; start decoding if its blocks can cover the
        step's outputs (`pd_stages.start_remote_decode`)."""
        bound = constrained.start_output_bound(request, ticks)
        if not self._ensure_kv(request, request.kv_tokens_needed(bound), step, may_suspend=False):
            return
        pd_stages.start_remote_decode(request, self.kv, step, bound)

    # -- PD transfer events (from the engine's connector) ---------------------------------------
    def kv_landed(self, identity: ExecutionIdentity) -> bool:
        """PD decode: every write of the request's handoff arrived; it starts decoding in the
        next step. False for an unknown or replaced identity (a stale event)."""
        request = self._current(identity)
        if request is None or request.stage is not RequestStage.AWAITING_KV:
            return False
        request.kv_landed = True
        return True

    def kv_sent(self, identity: ExecutionIdentity) -> bool:
        """PD prefill: every write to the decode instance completed; the request ends and its
        blocks and row are released. False for a stale event."""
        request = self._current(identity)
        if request is None or request.stage is not RequestStage.SENDING_KV:
            return False
        self._finish(request, FinishReason.STOP)
        return True

    def kv_transfer_failed(self, identity: ExecutionIdentity, message: str) -> bool:
        """The handoff failed or timed out: the request is aborted with `message` (on D its
        blocks and row stay held until `release_held`)."""
        request = self._current(identity)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT, error=message)
        return True

    def release_held(self, identity: ExecutionIdentity) -> None:
        """PD: a cancelled or failed handoff drained (or its lease expired): free the blocks
        and row it held."""
        if self._handoffs.release(identity):
            self.kv.free(identity)
            self._releases.append(identity)

    def held_transfers(self) -> frozenset[ExecutionIdentity]:
        """Finished PD requests whose blocks wait for their handoff to drain."""
        return self._handoffs.held_identities()

    def newly_reserved(self) -> list[ScheduledRequest]:
        """PD decode requests admitted since the last call (their KV target is now known)."""
        return self._handoffs.take_reserved()

    # -- KV growth and preemption (suspension.py) -----------------------------------------------
    def _ensure_kv(
        self, request: ScheduledRequest, num_tokens: int, step: StepBuilder, *, may_suspend: bool
    ) -> bool:
        """Blocks for positions [0, num_tokens), preempting if needed and allowed
        (`suspension.grow_or_preempt`). False: the request does not run in this step."""
        return suspension.grow_or_preempt(
            request,
            num_tokens,
            step,
            may_suspend=may_suspend,
            enable_preemption=self.config.enable_preemption,
            running=self._running,
            waiting=self._waiting,
            kv=self.kv,
            stats=self.stats,
        )

    def _preempt_for_priority(self, step: StepBuilder) -> None:
        """Before any row is selected: if the best waiting request cannot be admitted (no slot
        or not enough KV) and strictly lower-priority requests run, suspend them (worst first)
        until it can. Only the head of the queue may preempt, so one step preempts for at most
        one arrival."""
        if not (self.config.enable_preemption and self.config.policy is SchedulingPolicy.PRIORITY):
            return
        head = next((r for r in self._waiting if not self._waits_for_sibling(r)), None)
        if head is None:
            return
        prefix = self.kv.match_prefix(head.prompt_token_ids) if not head.preempted else NO_PREFIX
        suspension.preempt_for_head(
            head,
            prefix,
            step,
            config=self.config,
            running=self._running,
            waiting=self._waiting,
            kv=self.kv,
            stats=self.stats,
        )

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, ticks: int, step: StepBuilder) -> None:
        """Admit waiting requests in policy order with bounded bypass.

        A request that does not fit is deferred and later ones may pass it, but at most
        `admission_scan_limit` are examined, and once a deferred request has been passed
        `max_admission_bypasses` times nobody passes it any more (no starvation).
        """
        deferred: list[ScheduledRequest] = []
        scanned = 0
        for request in self._waiting:
            if scanned >= self.config.admission_scan_limit or step.prefill_room() <= 0:
                return
            if len(self._running) + self._handoffs.num_held >= self.config.max_num_seqs:
                return
            if self._waits_for_sibling(request):
                # Neither passed over nor scanned: it waits for its sibling's prompt, not for
                # room, so the n - 1 siblings of a large n never hide later requests.
                continue
            scanned += 1
            if self._try_admit(request, ticks, step):
                for waiting in deferred:
                    waiting.bypass_count += 1
                if any(w.bypass_count >= self.config.max_admission_bypasses for w in deferred):
                    return
            elif request.bypass_count >= self.config.max_admission_bypasses:
                return  # protected: it is next, whatever fits behind it
            else:
                deferred.append(request)

    def _waits_for_sibling(self, request: ScheduledRequest) -> bool:
        """`request` waits for a running sibling's prompt (`siblings.waits_for_sibling`)."""
        return siblings.waits_for_sibling(
            request, self._running, prefix_caching=self.prefix_caching
        )

    def plan_admission(self, request: ScheduledRequest, prefix: PrefixMatch) -> AdmissionPlan:
        """The block budget of admitting `request` now (see admission.plan_admission)."""
        return plan_admission(self.config, self.kv, request, prefix, self._running)

    def _try_admit(self, request: ScheduledRequest, ticks: int, step: StepBuilder) -> bool:
        prefix = (
            self.kv.match_prefix(request.prompt_token_ids) if not request.preempted else NO_PREFIX
        )
        if not self.plan_admission(request, prefix).fits(self.kv.capacity().free_blocks):
            return False
        if request.preempted:
            return suspension.resume(
                request,
                ticks,
                step,
                running=self._running,
                waiting=self._waiting,
                kv=self.kv,
                stats=self.stats,
            )
        initial_tokens = initial_allocation_tokens(self.config, request, prefix)
        updates = self.kv.allocate(
            request.identity, initial_tokens, prefix, prompt_length=request.prompt_length
        )
        if updates is None:
            return False
        # The first of its group to run computes the prompt for all (siblings.py).
        request.computes_group_prompt = siblings.computes_group_prompt(request, self._running)
        self._waiting.remove(request)
        self._running.append(request)
        start_admitted(request, prefix, updates, step, scheduled_time=time.monotonic())
        if request.awaits_kv:  # PD decode: the prompt's KV comes from a prefill instance
            self._handoffs.await_kv(request)
        else:
            self._schedule_prefill_chunk(request, ticks, step)
        return True

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, result: ModelRunnerOutput) -> None:
        """Apply the results of the oldest submitted step: prompt progress, then tokens."""
        submitted = self._in_flight.confirm_oldest(
            result.step_id, same_identity=self._same_identity, live=self._current
        )
        self.stats.steps += 1
        self.stats.decode_ticks += result.decode_ticks
        self.stats.loop_slots += result.loop_slots
        # Failure protocol (R04): the runner already dropped the named requests' device state;
        # each is aborted with the error (a preempted victim whose snapshot failed included: its
        # blocks were handed out, so it cannot resume). Release is queued by _finish.
        for failure in result.failures:
            for identity in failure.identities:
                request = self._current(identity)
                if request is not None:
                    self._finish(request, FinishReason.ABORT, error=failure.message)
        outputs.check_progress_evidence(submitted.output, result)
        for progress in result.prefill_progress:
            request = self._current(progress.identity)
            if request is not None:
                outputs.apply_prefill_progress(request, progress, self.kv, self.stats)
        now = time.monotonic() if result.generated else 0.0
        for generated in result.generated:
            request = self._current(generated.identity)
            if request is not None:
                self._record_tokens(request, generated, now)

    def _record_tokens(
        self, request: ScheduledRequest, generated: GeneratedTokens, now: float
    ) -> None:
        outputs.check_output_index(request, generated)
        self._dirty[request.identity.request_id] = request
        finish = outputs.record_generated(request, generated, now, self.stats)
        if finish is not None:
            self._finish(request, finish.reason, error=finish.error)

    # -- completion and outputs ----------------------------------------------------------------
    def _same_identity(self, identity: ExecutionIdentity) -> ScheduledRequest | None:
        """The known request with this identity, finished or not (None if replaced)."""
        request = self._requests.get(identity.request_id)
        return request if request is not None and request.identity == identity else None

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
        # PD: a transfer may still write this request's blocks and row (decode side), or read
        # them (prefill side, unless it ended because every write completed): hold them until
        # the transfer drained (`release_held`).
        awaiting_writes = pd_stages.holds_blocks_after(request, reason)
        request.stage = RequestStage.FINISHED
        request.constraint = None  # the matcher (host state) goes with the request
        request.finish_reason = reason
        request.error = error
        if awaiting_writes:  # a prefill instance may still write its blocks and row
            self._handoffs.hold(request)
        else:
            self.kv.free(request.identity)
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
