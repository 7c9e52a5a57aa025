"""`Scheduler`: owns request progression, batching and exit policy (module M3).

The engine drives it with a feedback loop that may run one step ahead of the device:

    output = scheduler.schedule()            # what the next step executes
    ...runner submits it; the previous step completes...
    scheduler.update_from_output(result)     # results of the oldest submitted step
    deltas = scheduler.take_outputs()        # new tokens per request

Steps are applied in submission order (README.md, "One step" and "Steps in flight"). This
module owns the queues and the request table, decides the step-building order and keeps the one
cleanup path (`_finish`); the modules it composes are README.md's "Modules" table. Request
timings (`RequestTimings`) are taken on the host's time.monotonic() clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rlt_contracts import (
    DEFAULT_GATE_MIN_LOOPS,
    AdmissionPlan,
    EngineRequest,
    ExecutionIdentity,
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    KVPort,
    KVTransferParams,
    ModelRunnerOutput,
    PrefixMatch,
    RequestOutputDelta,
    RequestStage,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    SpeculationConfig,
    TokenConstraint,
)
from rlt_contracts.kv import KVCapacity
from rlt_contracts.structured import ConstraintCompiler

from rlt_scheduler import constrained, outputs, pd_stages
from rlt_scheduler.admission_delay import AdmissionDelay
from rlt_scheduler.admitter import Admitter
from rlt_scheduler.decode_work import DecodeWork, decode_work, draft_tokens
from rlt_scheduler.exit_policy import ExitPolicy, HazardExitPolicy, LoopBounds
from rlt_scheduler.in_flight import StepsInFlight, SubmittedStep
from rlt_scheduler.intake import build_scheduled_request, check_waiting_room
from rlt_scheduler.request_queues import RequestQueues
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder
from rlt_scheduler.step_planner import StepPlanner
from rlt_scheduler.validation import ModelLimits, check_kv_transfer, validate_request


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
        default_min_loops: int = DEFAULT_GATE_MIN_LOOPS,
        default_loops: int | None = None,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        """`default_min_loops`: a request's min_loops when it sets none (the engine passes 1
        for a family without an exit signal).
        `default_loops`: a request's max_loops when it sets none (the engine passes the
        family's default depth; None: `model_depth`, the engine's loop cap). A prompt run
        below `model_depth` gets its loop count in its prefix-cache salt (intake.py).
        `prefix_caching`: `kv` publishes computed prompt pages for reuse (the engine passes
        its KV manager's setting); only then does a waiting request wait for pages a running
        request is computing (prefix_waits.py).
        `constraint_compiler`: builds the matchers of structured-output requests (None: such
        requests are rejected).
        `speculation`: the engine's speculative decoding (drafts per round; off by default)."""
        self.config = config
        self.speculation = speculation or SpeculationConfig(num_tokens=0)
        self.constraint_compiler = constraint_compiler
        self.prefix_caching = prefix_caching
        self.kv = kv
        self.model_depth = model_depth
        self.limits = ModelLimits(
            vocab_size, model_depth, max_model_len, default_min_loops, default_loops
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.exit_policy = exit_policy or HazardExitPolicy()
        config.check_depth(model_depth)
        self.stats = SchedulerStats()
        self.stats.spec_accepted_per_position = [0] * self.speculation.num_tokens
        self._requests: dict[str, ScheduledRequest] = {}
        # waiting queue, running list, PD handoffs; admission and step building share them
        self._queues = RequestQueues(config.policy)
        self._releases: list[ExecutionIdentity] = []
        self._dirty: dict[str, ScheduledRequest] = {}
        self._in_flight = StepsInFlight()
        self._next_generation = 0
        self._next_step = 0
        # requests queued since step `_fresh_step` was scheduled (no admission saw them yet)
        self._fresh: list[ScheduledRequest] = []
        self._fresh_step = 0
        self._start_deferred = False  # the last step was speculative, full, and a start waited
        self._delay = AdmissionDelay(config.scheduler_delay_factor)
        self._planner = StepPlanner(config, kv, self.stats, self._queues, model_depth=model_depth)
        self._admitter = Admitter(
            config, kv, self.stats, self._queues, self._planner, prefix_caching=prefix_caching
        )

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
            queued=len(self._queues.waiting),
            fresh_waiting=sum(1 for r in self._fresh if r.stage is RequestStage.WAITING),
            running=len(self._queues.running),
            held=self._queues.handoffs.num_held,
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
            model_depth=self.model_depth,
            draft_tokens=draft_tokens(self.speculation, new.sampling),
        )
        self._next_generation += 1
        self._requests[new.request_id] = request
        self._queues.waiting.add(request)
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
        return bool(self._queues.waiting or self._queues.running or self._queues.handoffs.num_held)

    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    @property
    def num_waiting(self) -> int:
        return len(self._queues.waiting)

    @property
    def num_submitted_steps(self) -> int:
        """Steps scheduled whose results were not applied yet."""
        return len(self._in_flight)

    def running_request_ids(self) -> list[str]:
        """Ids of admitted (running) requests, in admission order."""
        return [r.identity.request_id for r in self._queues.running]

    def waiting_request_ids(self) -> list[str]:
        """Ids of waiting (new or preempted) requests, in queue order."""
        return [r.identity.request_id for r in self._queues.waiting]

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
        step = self._planner.new_step()
        admission_held = self._admission_held()
        if not admission_held:
            self._admitter.preempt_for_priority(step)
        work = decode_work(
            self.config,
            self.speculation,
            self._queues.running,
            self._in_flight.unconfirmed_ticks,
            self._in_flight.unconfirmed_rounds,
            admission_possible=not admission_held and self._admitter.admission_possible(),
            model_depth=self.model_depth,
            start_deferred=self._start_deferred,
        )
        limit = self.speculation.disable_batch_size
        if work.speculative and limit is not None:
            decoding_now = sum(1 for r in self._queues.running if r.stage is RequestStage.DECODING)
            step.looping_room = limit - decoding_now
        self._planner.schedule_running(work, step)
        if not admission_held:
            # the clock is read through this module's `time` (tests patch it)
            self._admitter.admit(work, step, clock=time.monotonic)
        decoding = self._looping_rows(step)
        if not decoding:  # no decoding row and no request starting to decode: no decode
            work = DecodeWork()
        self._start_deferred = step.start_deferred
        output = step.build(
            self._next_step,
            released=tuple(self._releases),
            decode_ticks=work.ticks,
            speculative_rounds=work.rounds,
        )
        self._releases.clear()
        self._next_step += 1
        if self._delay.enabled:
            self._delay.step_scheduled(
                output.step_id, computes_prompts=bool(output.prefill), now=time.monotonic()
            )
        self._in_flight.submit(
            SubmittedStep(output, step.output_bounds, decoding), self._request_of
        )
        for identity in decoding:
            constrained.count_mask_ticks(self._request_of(identity), work)
        return output

    def _admission_held(self) -> bool:
        """`scheduler_delay_factor`: admission waits in this step (admission_delay.py)."""
        waiting = self._queues.waiting
        if not self._delay.enabled or not waiting:
            return False
        return self._delay.holds(
            min(r.queued_time for r in waiting),
            anything_running=bool(self._queues.running),
            now=time.monotonic(),
        )

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
        if self._queues.handoffs.release(identity):
            self.kv.free(identity)
            self._releases.append(identity)

    def held_transfers(self) -> frozenset[ExecutionIdentity]:
        """Finished PD requests whose blocks wait for their handoff to drain."""
        return self._queues.handoffs.held_identities()

    def newly_reserved(self) -> list[ScheduledRequest]:
        """PD decode requests admitted since the last call (their KV target is now known)."""
        return self._queues.handoffs.take_reserved()

    def plan_admission(self, request: ScheduledRequest, prefix: PrefixMatch) -> AdmissionPlan:
        """The block budget of admitting `request` now (see admission_budget.plan_admission)."""
        return self._admitter.plan_admission(request, prefix)

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, result: ModelRunnerOutput) -> None:
        """Apply the results of the oldest submitted step: prompt progress, then tokens."""
        submitted = self._in_flight.confirm_oldest(
            result.step_id, same_identity=self._same_identity, live=self._current
        )
        if self._delay.enabled:
            self._delay.step_applied(result.step_id, now=time.monotonic())
        self.stats.steps += 1
        self.stats.decode_ticks += result.decode_ticks
        self.stats.loop_slots += result.loop_slots
        if result.speculation is not None:
            self.stats.add_speculation(result.speculation)
        # Failure protocol (R04): the runner already dropped the named requests' device state;
        # each is aborted with the error (a preempted victim whose snapshot failed included: its
        # blocks were handed out, so it cannot resume). Release is queued by _finish.
        for failure in result.failures:
            for identity in failure.identities:
                request = self._current(identity)
                if request is not None:
                    self._finish(request, FinishReason.ABORT, error=failure.message)
        outputs.check_progress_evidence(submitted.output, result)
        # scores before progress: publishing a scored prompt's pages keeps their scores
        for scores in result.prompt_logprobs:
            request = self._current(scores.identity)
            if request is not None:
                outputs.record_prompt_logprobs(request, scores)
        for progress in result.prefill_progress:
            request = self._current(progress.identity)
            if request is not None:
                outputs.apply_prefill_progress(request, progress, self.kv, self.stats)
        now = time.monotonic() if result.generated else 0.0
        for generated in result.generated:
            request = self._current(generated.identity)
            if request is not None:
                self._record_tokens(request, generated, now)
        if result.speculative_rounds:
            outputs.end_tokens_between_rounds(submitted.decoding, self._current)

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
            self._queues.waiting.remove(request)  # new, or preempted
        else:
            self._queues.running.remove(request)
        # PD: a transfer may still write this request's blocks and row (decode side), or read
        # them (prefill side, unless it ended because every write completed): hold them until
        # the transfer drained (`release_held`).
        awaiting_writes = pd_stages.holds_blocks_after(request, reason)
        request.stage = RequestStage.FINISHED
        request.constraint = None  # the matcher (host state) goes with the request
        request.finish_reason = reason
        request.error = error
        if awaiting_writes:  # a prefill instance may still write its blocks and row
            self._queues.handoffs.hold(request)
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
