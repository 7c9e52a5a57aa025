"""`Admitter`: moves waiting requests into the running list while a step is built.

`preempt_for_priority` (before any row is selected: the best waiting request may suspend
strictly lower-priority running ones until it fits), then `admit` (waiting requests in policy
order with bounded bypass: at most `admission_scan_limit` are examined, and a deferred request
passed `max_admission_bypasses` times is passed no more). Both skip a request that waits for
pages a running request is computing (`prefix_waits.py`). README.md, "Modules" and "Admission
budget", gives the rules and what is local to one `admit` call (R03); no state of its own (R02).
"""

from __future__ import annotations

from collections.abc import Callable

from rlt_contracts import (
    NO_PREFIX,
    AdmissionPlan,
    BlockTableUpdate,
    KVPort,
    NewRequestData,
    PrefixMatch,
    RequestBlocks,
    RequestStage,
    SchedulerConfig,
    SchedulingPolicy,
)

from rlt_scheduler import preemption, prefix_waits, scored_prefix
from rlt_scheduler.admission_budget import (
    RunningGrowth,
    headroom_blocks,
    initial_allocation_tokens,
    plan_admission,
    running_growth,
)
from rlt_scheduler.decode_work import DecodeWork
from rlt_scheduler.request_queues import RequestQueues
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder
from rlt_scheduler.step_planner import StepPlanner


class Admitter:
    """Moves waiting requests into the step: priority preemption for the queue's head, then
    admission in queue order (a blocked request may be passed a bounded number of times)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVPort,
        stats: SchedulerStats,
        queues: RequestQueues,
        planner: StepPlanner,
        *,
        prefix_caching: bool,
    ) -> None:
        self.config = config
        self.kv = kv
        self.stats = stats
        self.queues = queues
        self.planner = planner
        self.prefix_caching = prefix_caching

    def preempt_for_priority(self, step: StepBuilder) -> None:
        """Before any row is selected: if the best waiting request cannot be admitted (no slot
        or not enough KV) and strictly lower-priority requests run, suspend them (worst first)
        until it can. Only the head of the queue may preempt, so one step preempts for at most
        one arrival."""
        if not (self.config.enable_preemption and self.config.policy is SchedulingPolicy.PRIORITY):
            return
        head = next((r for r in self.queues.waiting if not self.waits_for_prefix(r)), None)
        if head is None:
            return
        prefix = self._prefix_of(head)
        preemption.preempt_for_head(
            head,
            prefix,
            step,
            config=self.config,
            queues=self.queues,
            kv=self.kv,
            stats=self.stats,
        )

    def admit(self, work: DecodeWork, step: StepBuilder, *, clock: Callable[[], float]) -> None:
        """Admit waiting requests in policy order with bounded bypass (module docstring).
        `clock`: host monotonic seconds, read once per newly admitted request (its
        `scheduled_time`)."""
        config = self.config
        deferred: list[ScheduledRequest] = []
        scanned = 0
        growth = None  # of the running requests; None: to be (re)computed
        for request in self.queues.waiting:
            if scanned >= config.admission_scan_limit or step.prefill_room() <= 0:
                return
            if self.queues.occupied_slots >= config.max_num_seqs:
                return
            if self.waits_for_prefix(request):
                # Neither passed over nor scanned: it waits for pages a running request is
                # computing, not for room, so the n - 1 siblings of a large n or the other
                # choices of a question never hide later requests.
                continue
            scanned += 1
            if growth is None:
                growth = running_growth(config, self.kv, self.queues.running)
                if self._nobody_fits(growth):
                    return  # every try would fail and change nothing
            if self._try_admit(request, growth, work, step, clock=clock):
                growth = None  # one more running request
                for waiting in deferred:
                    waiting.bypass_count += 1
                if any(w.bypass_count >= config.max_admission_bypasses for w in deferred):
                    return
            elif request.bypass_count >= config.max_admission_bypasses:
                return  # protected: it is next, whatever fits behind it
            else:
                deferred.append(request)

    def admission_possible(self) -> bool:
        """Whether a waiting request can start in this step (pure): a slot is free and the
        first request `admit` would examine fits next to the running requests' reserved growth,
        its prefix reuse counted. It decides whether the step stays one tick long so the
        prompt starts at once (`tick_policy.decode_ticks`); a request that fits behind a
        blocked one is still admitted by `admit`, in a longer step."""
        if self.queues.occupied_slots >= self.config.max_num_seqs:
            return False
        head = next((r for r in self.queues.waiting if not self.waits_for_prefix(r)), None)
        if head is None:
            return False
        growth = running_growth(self.config, self.kv, self.queues.running)
        if self._nobody_fits(growth):
            return False  # cheap early answer, before any prefix lookup
        plan = plan_admission(self.config, self.kv, head, self._prefix_of(head), growth)
        return plan.fits(self.kv.capacity().free_blocks)

    def _nobody_fits(self, growth: RunningGrowth) -> bool:
        """Even a request needing no block of its own would not fit: the running requests'
        reserved growth plus the watermark headroom exceed the free blocks."""
        floor = growth.reserved_blocks + headroom_blocks(self.config, self.kv, growth)
        return floor > self.kv.capacity().free_blocks

    def _prefix_of(self, request: ScheduledRequest) -> PrefixMatch:
        """Reusable cached prefix of a new request (a resumed one restores its snapshot; a
        prompt to score reuses only pages that carry its scores: scored_prefix.py)."""
        if request.preempted:
            return NO_PREFIX
        return scored_prefix.match(self.kv, request)

    def waits_for_prefix(self, request: ScheduledRequest) -> bool:
        """`request` waits for leading pages a running request is computing and has not read
        back yet (`prefix_waits.waits_for_prefix`)."""
        return prefix_waits.waits_for_prefix(
            self.kv, request, self.queues.running, prefix_caching=self.prefix_caching
        )

    def plan_admission(self, request: ScheduledRequest, prefix: PrefixMatch) -> AdmissionPlan:
        """The block budget of admitting `request` now (see admission_budget.plan_admission)."""
        growth = running_growth(self.config, self.kv, self.queues.running)
        return plan_admission(self.config, self.kv, request, prefix, growth)

    def _try_admit(
        self,
        request: ScheduledRequest,
        growth: RunningGrowth,
        work: DecodeWork,
        step: StepBuilder,
        *,
        clock: Callable[[], float],
    ) -> bool:
        """Admit `request` if its budget fits next to the running requests' `growth` and its
        blocks can be allocated. False: nothing changed (it stays waiting)."""
        queues = self.queues
        prefix = self._prefix_of(request)
        plan = plan_admission(self.config, self.kv, request, prefix, growth)
        if not plan.fits(self.kv.capacity().free_blocks):
            return False
        if request.preempted:
            return preemption.resume(
                request, work, step, queues=queues, kv=self.kv, stats=self.stats
            )
        initial_tokens = initial_allocation_tokens(self.config, request, prefix)
        updates = self.kv.allocate(
            request.identity, initial_tokens, prefix, prompt_length=request.prompt_length
        )
        if updates is None:
            return False
        queues.waiting.remove(request)
        queues.running.append(request)
        start_admitted(request, prefix, updates, step, scheduled_time=clock())
        if request.awaits_kv:  # PD decode: the prompt's KV comes from a prefill instance
            queues.handoffs.await_kv(request)
        else:
            self.planner.schedule_prefill_chunk(request, work, step)
        return True


def start_admitted(
    request: ScheduledRequest,
    prefix: PrefixMatch,
    updates: tuple[BlockTableUpdate, ...],
    step: StepBuilder,
    *,
    scheduled_time: float,
) -> None:
    """A new request got its first blocks (`updates`, reusing `prefix`) and joined the running
    list: it enters PREFILL with the reused prefix counted as scheduled and computed (a scored
    prompt takes the reused pages' scores), and the step introduces it to the runner (request
    data, then its block mapping). Selected into the
    step, so it is never a preemption victim of its own step. `scheduled_time`: host monotonic
    seconds of its first admission."""
    request.stage = RequestStage.PREFILL
    request.scheduled_time = scheduled_time
    request.scheduled_prompt_tokens = request.computed_prompt_tokens = prefix.num_tokens
    scored_prefix.take_cached_scores(request, prefix)
    request.known_to_runner = True
    step.selected.add(request.identity)
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
