"""`Scheduler`: owns request progression, batching and exit policy (module M3).

The engine drives it with a feedback loop that may run one step ahead of the device:

    output = scheduler.schedule()            # what the next step executes
    ...runner submits it; the previous step completes...
    scheduler.update_from_output(result)     # results of the oldest submitted step
    deltas = scheduler.take_outputs()        # new tokens per request

Steps are applied in submission order. Between schedule() of step n and update_from_output()
of step n, later steps may be scheduled: prompt chunks advance optimistically (they are
deterministic), decoding rows keep running on the device, and every decoding request's blocks
cover the most outputs the submitted steps can produce (`unconfirmed_tokens`).

A step holds prefill chunks under the token budget and `decode_ticks` loop ticks for every
decoding request. While prompts are waiting to be computed a step runs one tick, so prefill is
never held up; otherwise several ticks (up to `decode_ticks_per_step`, and in refill mode no
more than the longest request can still use) run per host round trip.

Siblings (requests with the same `EngineRequest.sibling_group` and the same prompt, e.g. the
n choices of one HTTP request) compute their prompt once when the KV manager has a prefix
cache (`prefix_caching`): while one of them is admitted and its prompt is not fully computed,
the others stay waiting (they neither take a slot nor count as passed over), and once its
prompt pages are published they are admitted and reuse every full page. Without a prefix
cache there is nothing to reuse, and siblings are scheduled as independent requests.

Each request records when it was queued (add_request), first admitted (schedule) and when the
results holding its first and latest tokens were applied (update_from_output), on the host's
time.monotonic() clock; its final delta reports them (`RequestTimings`).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from msgspec import structs
from rlt_contracts import (
    NO_PREFIX,
    AdmissionPlan,
    DecodeRule,
    EngineRequest,
    ExecutionIdentity,
    FinishReason,
    GeneratedTokens,
    InvalidRequestError,
    KVPort,
    KVTransferParams,
    ModelRunnerOutput,
    NewRequestData,
    OverloadedError,
    PDRole,
    PrefillChunk,
    PrefixMatch,
    RequestBlocks,
    RequestOutputDelta,
    RequestStage,
    SamplingParams,
    SchedulerOutput,
    TokenConstraint,
    TokenMask,
)
from rlt_contracts.kv import KVCapacity
from rlt_contracts.structured import ConstraintCompiler

from rlt_scheduler.admission import initial_allocation_tokens, plan_admission
from rlt_scheduler.config import SchedulerConfig, SchedulingPolicy
from rlt_scheduler.exit_policy import ExitPolicy, LoopBounds, OuroExitPolicy
from rlt_scheduler.preemption import choose_victim
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder
from rlt_scheduler.tick_policy import decode_ticks, tick_output_bound
from rlt_scheduler.validation import ModelLimits, check_kv_transfer, validate_request
from rlt_scheduler.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class _SubmittedStep:
    """A scheduled step whose results have not been applied yet."""

    output: SchedulerOutput
    output_bounds: dict[ExecutionIdentity, int]
    decoding: frozenset[ExecutionIdentity]


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
        self._submitted: deque[_SubmittedStep] = deque()
        self._unconfirmed_ticks: dict[ExecutionIdentity, int] = {}
        self._held: dict[ExecutionIdentity, ScheduledRequest] = {}  # PD: blocks a writer may hit
        self._reserved: list[ScheduledRequest] = []  # PD decode: admitted, target not reported
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
        return prompt, bounds, self._constraint(request)

    def _constraint(self, request: EngineRequest) -> TokenConstraint | None:
        """A fresh matcher for a structured-output request (none on a PD prefill instance,
        which samples nothing). Compile errors are InvalidRequestErrors naming the field."""
        spec = request.sampling.structured_output
        if spec is None or (
            request.kv_transfer is not None and request.kv_transfer.role is PDRole.PREFILL
        ):
            return None
        if self.constraint_compiler is None:
            raise InvalidRequestError(spec.field, "structured output is not available here")
        return self.constraint_compiler.compile(spec)

    def _check_waiting_room(self, count: int) -> None:
        """`max_waiting_requests` bounds the requests that really wait: those a step already
        left waiting (no slot, KV or budget for them), plus the ones queued since the last
        step beyond the runner slots free now (a free slot takes such a request at the next
        step; none is free for them while older requests were left waiting, since what holds
        those back holds them too). A batch larger than the limit plus every slot can never
        be queued."""
        config = self.config
        if count > config.max_waiting_requests + config.max_num_seqs:
            raise InvalidRequestError(
                "prompt",
                f"{count} prompts at once exceed what the engine can queue "
                f"({config.max_waiting_requests} waiting + {config.max_num_seqs} running)",
            )
        if self._fresh_step != self._next_step:  # a step ran: every queued request was seen
            self._fresh, self._fresh_step = [], self._next_step
        fresh = sum(1 for r in self._fresh if r.stage is RequestStage.WAITING)
        left_waiting = len(self._waiting) - fresh
        free_slots = 0
        if not left_waiting:
            free_slots = max(config.max_num_seqs - len(self._running) - len(self._held), 0)
        waiting = left_waiting + max(fresh + count - free_slots, 0)
        if waiting > config.max_waiting_requests:
            raise OverloadedError(
                f"{len(self._waiting)} requests are queued and {free_slots} runner slots are "
                f"free for them: {count} more would leave {waiting} waiting (limit "
                f"{config.max_waiting_requests}); retry later"
            )

    def _enqueue(
        self,
        new: EngineRequest,
        prompt: tuple[int, ...],
        bounds: LoopBounds,
        constraint: TokenConstraint | None,
    ) -> ScheduledRequest:
        request_id, sampling = new.request_id, new.sampling
        if sampling.seed is None:
            sampling = structs.replace(sampling, seed=secrets.randbits(63))
        stop_ids = tuple(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids += tuple(t for t in self.eos_token_ids if t not in stop_ids)
        request = ScheduledRequest(
            identity=ExecutionIdentity(request_id, self._next_generation),
            prompt_token_ids=prompt,
            sampling=sampling,
            bounds=bounds,
            rule=DecodeRule(
                exit=self.exit_policy.rule(request_id, bounds, sampling.max_tokens),
                max_tokens=sampling.max_tokens,
                stop_token_ids=stop_ids,
                one_output_per_step=constraint is not None,
            ),
            arrival_index=self._next_generation,
            queued_time=time.monotonic(),
            kv_transfer=new.kv_transfer,
            sibling_group=new.sibling_group,
            constraint=constraint,
        )
        self._next_generation += 1
        self._requests[request_id] = request
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
        return bool(self._waiting or self._running or self._held)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_submitted_steps(self) -> int:
        """Steps scheduled whose results were not applied yet."""
        return len(self._submitted)

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
            config, self._running, len(self._running), len(self._waiting), self._unconfirmed_ticks
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
        starts_decoding = bool(step.remote_starts) or any(
            c.completes_prompt and not self._requests[c.identity.request_id].prefill_only
            for c in step.prefill
        )
        if not (step.decoding or starts_decoding):
            ticks = 0
        output = step.build(self._next_step, released=tuple(self._releases), decode_ticks=ticks)
        self._releases.clear()
        self._next_step += 1
        decoding = (
            frozenset(step.decoding)
            | frozenset(step.remote_starts)
            | frozenset(
                c.identity
                for c in step.prefill
                if c.completes_prompt and not self._requests[c.identity.request_id].prefill_only
            )
        )
        self._submitted.append(_SubmittedStep(output, step.output_bounds, decoding))
        for identity in decoding:
            self._unconfirmed_ticks[identity] = self._unconfirmed_ticks.get(identity, 0) + ticks
            request = self._requests[identity.request_id]
            if request.constraint is not None:
                request.mask_ticks += ticks
        for identity, bound in step.output_bounds.items():
            self._requests[identity.request_id].unconfirmed_tokens += bound
        return output

    def _schedule_decode(self, request: ScheduledRequest, ticks: int, step: StepBuilder) -> None:
        bound = self._decode_output_bound(request, ticks)
        outputs = request.num_outputs + request.unconfirmed_tokens + bound
        if self._ensure_kv(request, request.kv_tokens_needed(outputs), step, may_suspend=True):
            step.add_decode(request.identity, bound)
            self._send_mask_if_due(request, step)

    @staticmethod
    def _decode_output_bound(request: ScheduledRequest, ticks: int) -> int:
        """Most outputs a decoding request can make in a step of `ticks` ticks. A constrained
        request (structured output) makes one per token mask: one if this step brings the
        next mask; else one if its current mask's token may still come (no step in flight
        counts it), otherwise none (it is held on the device until its next mask)."""
        bound = tick_output_bound(request, ticks, fresh=False)
        if request.constraint is None:
            return bound
        if not request.mask_sent:
            return min(bound, 1)
        return min(bound, max(1 - request.unconfirmed_tokens, 0))

    def _send_mask_if_due(self, request: ScheduledRequest, step: StepBuilder) -> None:
        """Structured output: once the previous output was read back and accepted (so no step
        in flight can sample for the request), send the next output's allowed-token bitmask.
        The device holds the row after each output until its next mask arrives."""
        if request.constraint is None or request.mask_sent:
            return
        step.token_masks.append(
            TokenMask(request.identity, request.constraint.allowed_token_bitmask())
        )
        request.mask_sent = True
        request.mask_ticks = 0

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
        bound = self._start_output_bound(request, ticks) if starts else 0
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
            self._send_token0_mask(request, step)

    @staticmethod
    def _start_output_bound(request: ScheduledRequest, ticks: int) -> int:
        """Outputs of the step that samples token 0: token 0 plus what the ticks can make
        (nothing more for a constrained request: it holds until its next mask)."""
        if request.constraint is not None:
            return 1
        return 1 + tick_output_bound(request, ticks, fresh=True)

    def _send_token0_mask(self, request: ScheduledRequest, step: StepBuilder) -> None:
        """Structured output: token 0 is sampled in this step under the grammar's first mask
        (it is certain to come, so no loops are left to wait for: `mask_ticks` = max)."""
        if request.constraint is not None:
            self._send_mask_if_due(request, step)
            request.mask_ticks = request.bounds.max_loops

    def _schedule_remote_start(
        self, request: ScheduledRequest, ticks: int, step: StepBuilder
    ) -> None:
        """PD decode: the prompt's KV and final state landed; token 0 is sampled in this step
        and the row decodes in its ticks, as after a prompt completed here."""
        bound = self._start_output_bound(request, ticks)
        if not self._ensure_kv(request, request.kv_tokens_needed(bound), step, may_suspend=False):
            return
        request.stage = RequestStage.DECODING
        request.kv_landed = False
        request.scheduled_prompt_tokens = request.computed_prompt_tokens = request.prompt_length
        self.kv.publish_prefix(request.identity, request.prompt_token_ids, request.prompt_length)
        step.add_remote_start(request.identity, bound)
        self._send_token0_mask(request, step)

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
        if self._held.pop(identity, None) is not None:
            self.kv.free(identity)
            self._releases.append(identity)

    def held_transfers(self) -> frozenset[ExecutionIdentity]:
        """Finished PD requests whose blocks wait for their handoff to drain."""
        return frozenset(self._held)

    def newly_reserved(self) -> list[ScheduledRequest]:
        """PD decode requests admitted since the last call (their KV target is now known)."""
        reserved, self._reserved = self._reserved, []
        return reserved

    # -- KV growth and preemption ---------------------------------------------------------------
    def _ensure_kv(
        self, request: ScheduledRequest, num_tokens: int, step: StepBuilder, *, may_suspend: bool
    ) -> bool:
        """Make the request's blocks cover positions [0, num_tokens), preempting another request
        once if that is allowed and needed. A decoding request that still cannot grow is
        suspended itself (`may_suspend`), since the device would otherwise run it. False: the
        request does not run in this step."""
        updates = self.kv.grow(request.identity, num_tokens)
        if updates is None and self.config.enable_preemption:
            victim = choose_victim(
                self._running,
                excluded=step.selected | {request.identity} | self._transfer_endpoints(),
                held_blocks=self.kv.held_blocks,
            )
            if victim is not None:
                self._preempt(victim, step)
                updates = self.kv.grow(request.identity, num_tokens)
        if updates is None:
            if not may_suspend:
                return False
            if not self.config.enable_preemption:
                raise RuntimeError(
                    f"{request.identity}: KV growth failed although admission reserved it"
                )
            self._preempt(request, step)
            return False
        if updates:
            step.block_updates.append(RequestBlocks(request.identity, updates))
        return True

    def _transfer_endpoints(self) -> set[ExecutionIdentity]:
        """Requests whose blocks a KV transfer reads or writes: never preemption victims."""
        busy = (RequestStage.AWAITING_KV, RequestStage.SENDING_KV)
        return {r.identity for r in self._running if r.stage in busy}

    def _preempt(self, victim: ScheduledRequest, step: StepBuilder) -> None:
        """Suspend `victim`: the runner snapshots its device state first thing in this step; its
        blocks are free for the rest of the step; it waits to be resumed exactly where it was."""
        step.snapshots.append(victim.identity)
        victim.snapshot_tokens = self.kv.allocated_tokens(victim.identity)
        victim.resume_stage = victim.stage
        self.kv.free(victim.identity)
        self._running.remove(victim)
        victim.stage = RequestStage.WAITING
        self._waiting.add(victim)
        self.stats.preemptions += 1

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
        while len(self._running) >= self.config.max_num_seqs or not self.plan_admission(
            head, prefix
        ).fits(self.kv.capacity().free_blocks):
            victim = choose_victim(
                self._running,
                excluded=step.selected | self._transfer_endpoints(),
                held_blocks=self.kv.held_blocks,
                worse_than_priority=head.sampling.priority,
            )
            if victim is None:
                return
            self._preempt(victim, step)

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
            if len(self._running) + len(self._held) >= self.config.max_num_seqs:
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

    def _running_siblings(self, request: ScheduledRequest) -> list[ScheduledRequest]:
        """Admitted requests of `request`'s group with the same prompt."""
        if request.sibling_group is None:
            return []
        return [
            other
            for other in self._running
            if other.sibling_group == request.sibling_group
            and other is not request
            and other.prompt_token_ids == request.prompt_token_ids
        ]

    def _waits_for_sibling(self, request: ScheduledRequest) -> bool:
        """The sibling that computes the group's prompt has not read it back yet: admitting
        `request` now would compute it a second time, since those pages are published only once
        the results are read back (completion evidence, R18). Never with no prefix cache to
        publish into, and never for a preempted request (it restores its own snapshot)."""
        if not self.prefix_caching or request.preempted:
            return False
        return any(
            other.computes_group_prompt and other.computed_prompt_tokens < other.prompt_length
            for other in self._running_siblings(request)
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
            return self._resume(request, ticks, step)
        initial_tokens = initial_allocation_tokens(self.config, request, prefix)
        updates = self.kv.allocate(
            request.identity, initial_tokens, prefix, prompt_length=request.prompt_length
        )
        if updates is None:
            return False
        # The first of its group to run computes the prompt for all (no sibling runs: none
        # computed it, or the one that did is gone and only its published pages remain).
        request.computes_group_prompt = (
            request.sibling_group is not None and not self._running_siblings(request)
        )
        self._waiting.remove(request)
        self._running.append(request)
        request.stage = RequestStage.PREFILL
        request.scheduled_time = time.monotonic()
        request.scheduled_prompt_tokens = request.computed_prompt_tokens = prefix.num_tokens
        request.known_to_runner = True
        step.selected.add(request.identity)  # never a preemption victim of its own step
        step.new_requests.append(
            NewRequestData(
                request.identity,
                request.sampling,
                request.prompt_length,
                request.rule,
                prefill_only=request.prefill_only,
                prompt_token_ids=request.prompt_token_ids,
            )
        )
        step.block_updates.append(RequestBlocks(request.identity, updates))
        if request.awaits_kv:  # PD decode: the prompt's KV comes from a prefill instance
            request.stage = RequestStage.AWAITING_KV
            self._reserved.append(request)
        else:
            self._schedule_prefill_chunk(request, ticks, step)
        return True

    def _resume(self, request: ScheduledRequest, ticks: int, step: StepBuilder) -> bool:
        """Give a preempted request blocks covering its snapshot; the runner restores it
        before this step's work. It continues from the same stage, loop and exit state: a
        decoding request also gets the blocks of this step's ticks and loops in them, a
        prefilling one continues with its next chunk from the next step on."""
        tokens, bound = request.snapshot_tokens, 0
        if request.resume_stage is RequestStage.DECODING:
            bound = self._decode_output_bound(request, ticks)
            outputs = request.num_outputs + request.unconfirmed_tokens + bound
            tokens = max(tokens, request.kv_tokens_needed(outputs))
        updates = self.kv.allocate(request.identity, tokens, NO_PREFIX)
        if updates is None:
            return False
        self._waiting.remove(request)
        self._running.append(request)
        request.stage = request.resume_stage
        request.snapshot_tokens = request.resume_stage = None
        step.block_updates.append(RequestBlocks(request.identity, updates))
        step.restores.append(request.identity)
        self.stats.resumptions += 1
        if request.stage is RequestStage.DECODING:
            step.add_decode(request.identity, bound)
            self._send_mask_if_due(request, step)  # after the restore (runner order)
        else:
            step.selected.add(request.identity)
        return True

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, result: ModelRunnerOutput) -> None:
        """Apply the results of the oldest submitted step: prompt progress, then tokens."""
        if not self._submitted or self._submitted[0].output.step_id != result.step_id:
            expected = self._submitted[0].output.step_id if self._submitted else None
            raise RuntimeError(f"result of step {result.step_id}, expected step {expected}")
        submitted = self._submitted.popleft()
        self.stats.steps += 1
        self.stats.decode_ticks += result.decode_ticks
        self.stats.loop_slots += result.loop_slots
        for identity, bound in submitted.output_bounds.items():
            request = self._requests.get(identity.request_id)
            if request is not None and request.identity == identity:
                request.unconfirmed_tokens -= bound
        for identity in submitted.decoding:
            request = self._current(identity)
            if request is not None:
                request.confirmed_ticks += submitted.output.decode_ticks
            left = self._unconfirmed_ticks.get(identity, 0) - submitted.output.decode_ticks
            if left > 0:
                self._unconfirmed_ticks[identity] = left
            else:
                self._unconfirmed_ticks.pop(identity, None)
        # Failure protocol (R04): the runner already dropped the named requests' device state;
        # each is aborted with the error (a preempted victim whose snapshot failed included: its
        # blocks were handed out, so it cannot resume). Release is queued by _finish.
        for failure in result.failures:
            for identity in failure.identities:
                request = self._current(identity)
                if request is not None:
                    self._finish(request, FinishReason.ABORT, error=failure.message)
        self._check_progress_evidence(submitted.output, result)
        for progress in result.prefill_progress:
            request = self._current(progress.identity)
            if request is not None:
                self.stats.prompt_tokens += progress.end_position - request.computed_prompt_tokens
                request.computed_prompt_tokens = progress.end_position
                if request.stage is not RequestStage.WAITING:
                    self.kv.publish_prefix(
                        request.identity, request.prompt_token_ids, progress.end_position
                    )
        now = time.monotonic() if result.generated else 0.0
        for generated in result.generated:
            request = self._current(generated.identity)
            if request is not None:
                self._record_tokens(request, generated, now)

    @staticmethod
    def _check_progress_evidence(step: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Prompt progress is completion evidence for a chunk of that very step (R18): progress
        for any other range, or from a step that failed as a whole, is a runner bug."""
        chunks = {(c.identity, c.end_position) for c in step.prefill}
        for progress in result.prefill_progress:
            if result.step_failed or (progress.identity, progress.end_position) not in chunks:
                raise RuntimeError(
                    f"step {result.step_id} reports prompt progress {progress} that none of its "
                    "completed chunks establishes"
                )

    def _record_tokens(
        self, request: ScheduledRequest, generated: GeneratedTokens, now: float
    ) -> None:
        if generated.first_output_index != request.num_outputs:
            raise RuntimeError(
                f"{request.identity}: output {generated.first_output_index} reported, "
                f"{request.num_outputs} expected next"
            )
        self._dirty[request.identity.request_id] = request
        if generated.token_ids:
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
        for i, token in enumerate(generated.token_ids):
            depth = generated.exit_depths[i]
            request.output_token_ids.append(token)
            request.exit_depths.append(depth)
            if generated.logprobs is not None and generated.top_logprobs is not None:
                request.logprobs.append(generated.logprobs[i])
                request.top_logprobs.append(generated.top_logprobs[i])
            self.stats.generation_tokens += 1
            if request.num_outputs > 1:
                self.stats.decode_loops += depth
            if request.constraint is not None and not self._advance_constraint(request, token):
                return
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                return

    def _advance_constraint(self, request: ScheduledRequest, token_id: int) -> bool:
        """Structured output: the matcher consumes the output (its mask was used up, so the
        next one is due). A token the grammar rejects cannot come from a masked row: the
        request is aborted with the error rather than continued off the grammar."""
        request.mask_sent = False
        if request.constraint.accept_token(token_id):
            return True
        self._finish(
            request,
            FinishReason.ABORT,
            error=f"token {token_id} (output {request.num_outputs - 1}) violates the grammar",
        )
        return False

    def _finish_reason(self, request: ScheduledRequest, token_id: int) -> FinishReason | None:
        if token_id in request.rule.stop_token_ids:
            return FinishReason.STOP
        if request.constraint is not None and request.constraint.is_terminated():
            return FinishReason.STOP  # the grammar is complete (vLLM's rule)
        if request.num_outputs >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

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
        # PD: a transfer may still write this request's blocks and row (decode side), or read
        # them (prefill side, unless it ended because every write completed): hold them until
        # the transfer drained (`release_held`).
        awaiting_writes = request.stage is RequestStage.AWAITING_KV or (
            request.prefill_only
            and request.stage in (RequestStage.PREFILL, RequestStage.SENDING_KV)
            and reason is FinishReason.ABORT
        )
        request.stage = RequestStage.FINISHED
        request.constraint = None  # the matcher (host state) goes with the request
        request.finish_reason = reason
        request.error = error
        if awaiting_writes:  # a prefill instance may still write its blocks and row
            self._held[request.identity] = request
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
