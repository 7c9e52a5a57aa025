"""`EngineCore`: drives schedule -> submit -> collect -> update (module M2).

The only boundary the `LLM` and serving layers use: requests go in through `add_request` /
`abort_request` / `finish_request`, deltas come out of `step()`.

Asynchronous pipeline (default): a step is submitted to the runner, then the results of the
step submitted before it are collected and applied while the device computes the new one.
Submission, device completion and output delivery are distinct progress points (R18):

    host:    schedule n+1 | submit n+1 | collect n (wait) | update n, deltas n | schedule n+2 ...
    device:  ......... step n ........ | ......... step n+1 ......... | ...

At most one step is in flight while the host works; a step with no model work drains the
pipeline. KV blocks of a request that finishes or is aborted while steps are in flight are
freed at once: the device executes steps in submission order, so any later use of the blocks
is queued behind the in-flight work that may still write them, and the late results of that
work are dropped by execution identity (R15, R17). `async_scheduling=False` collects every step
right after submitting it; results are identical.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rlt_contracts import (
    EngineRequest,
    EngineStats,
    FamilyDeclaration,
    Feature,
    FinishReason,
    InvalidRequestError,
    KVLayout,
    KVTransferParams,
    PromptMask,
    RequestOutputDelta,
    SamplingParams,
    SchedulerOutput,
)
from rlt_kv import KVCacheManager
from rlt_runner import ModelRunner, PendingStep
from rlt_scheduler import ScheduledRequest, Scheduler

from rlt.engine.pd_link import NoPD, PDLink


def prompt_scoring_refusal(family: FamilyDeclaration) -> str | None:
    """Why a request of this family may not score its prompt (`prompt_logprobs`, echo with
    logprobs), or None. A prefix-LM prompt is one bidirectional block: position p attends to
    token p + 1 itself, so its logits are no log-probability of that token (and a decode fed
    the prompt token by token, `score_at_exit_depth`, would compute another prompt mask)."""
    if family.prompt_mask is not PromptMask.PREFIX_LM:
        return None
    return (
        f"{family.name} prompts are prefix-LM blocks (every prompt position attends to the "
        "whole prompt, the token it would score included), so prompt tokens have no "
        "log-probabilities; prompt scoring needs a causal prompt mask"
    )


@dataclass
class StepTimings:
    """Cumulative wall-clock seconds of the engine loop's phases (host clock).

    submit_s: scheduling plus queueing device work; collect_s: waiting for read-backs
    (`readback_wait_s`) plus parsing them; update_s: applying results and building deltas.
    """

    steps: int = 0
    decode_ticks: int = 0  # loop ticks of the collected steps
    schedule_s: float = 0.0
    submit_s: float = 0.0
    collect_s: float = 0.0
    readback_wait_s: float = 0.0
    update_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Host time not spent waiting for the device."""
        return (
            self.schedule_s + self.submit_s + self.collect_s - self.readback_wait_s + self.update_s
        )


@dataclass(frozen=True)
class StepRecord:
    """One applied step, for throughput accounting: `done_s` is the host clock
    (time.perf_counter) when its results were available; `generated` tokens it produced.

    device_s (CUDA): seconds on the device clock from the end of the previous step's device
    work to the end of this one's, idle time included. Unlike differences of `done_s`, it does
    not charge a step with host work done for a later one (the pipeline submits step n + 1,
    e.g. a long eager prefill, before it collects step n). None on the CPU or for a step with
    nothing to read back.
    device_idle_s (CUDA): the part of device_s before this step's first operation, when the
    device had nothing to do because the host had not submitted the step yet.
    scheduled_s / submitted_s: the host clock when the step's scheduling began and when its
    submission returned; decode_rows: rows its decode ran."""

    step_id: int
    prefill_tokens: int
    decode_ticks: int
    generated: int
    done_s: float
    device_s: float | None = None
    device_idle_s: float | None = None
    scheduled_s: float = 0.0
    submitted_s: float = 0.0
    decode_rows: int = 0


class EngineCore:
    """Not thread-safe; frontends serialize access (one engine thread). `pd`: the PD part of
    a prefill or decode instance (`PDLink`); `NoPD` for a whole engine."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        kv: KVCacheManager,
        *,
        pd: PDLink | NoPD | None = None,
        async_scheduling: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.pd = pd if pd is not None else NoPD()
        self.async_scheduling = async_scheduling
        self.timings = StepTimings()
        self.step_log: list[StepRecord] | None = None  # set to a list to record every step
        # each submitted step with the host clock when its scheduling began and its submit ended
        self._inflight: deque[tuple[SchedulerOutput, PendingStep, float, float]] = deque()
        self._last_event = None  # the latest collected step's end-of-work event (CUDA)
        self._pd_deltas: list[RequestOutputDelta] = []
        self._prompt_scoring_refusal = prompt_scoring_refusal(runner.model.family)
        self._exit_depth_scoring_refusal = (
            runner.model.family.refusal(Feature.EXIT_DEPTH_SCORING)
            or (
                f"exit policy {scheduler.exit_policy.name!r} reads the next-token distribution, "
                "which exit-depth scoring does not compute"
                if scheduler.exit_policy.reads_distribution
                else None
            )
            or (
                f"kv_layout {runner.layout}: exit-depth scoring runs prompts as decoding does over "
                "last_exited or shared KV only"
                if runner.layout.kind is KVLayout.RING
                else None
            )
        )

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        kv_transfer: KVTransferParams | None = None,
    ) -> ScheduledRequest:
        request = EngineRequest(request_id, tuple(prompt_token_ids), sampling, 0.0, kv_transfer)
        return self.add_requests((request,))[0]

    def add_requests(self, requests: Sequence[EngineRequest]) -> list[ScheduledRequest]:
        """Queue several requests, all or none (Scheduler.add_requests)."""
        for request in requests:
            self._check_request_options(request)
        return self.scheduler.add_requests(requests)

    def _check_request_options(self, request: EngineRequest) -> None:
        if request.sampling.prompt_logprobs is not None and self._prompt_scoring_refusal:
            raise InvalidRequestError("prompt_logprobs", self._prompt_scoring_refusal)
        if request.sampling.score_at_exit_depth and self._exit_depth_scoring_refusal:
            raise InvalidRequestError("score_at_exit_depth", self._exit_depth_scoring_refusal)
        kv_transfer = request.kv_transfer
        if kv_transfer is not None and request.sampling.prompt_logprobs is not None:
            # the prompt is computed on the prefill instance, which reports no scores
            raise InvalidRequestError(
                "prompt_logprobs", "prompt scoring is not available through a prefill/decode pair"
            )
        if kv_transfer is not None and kv_transfer.role is not self.pd.role:
            raise InvalidRequestError(
                "kv_transfer_params.role",
                f"this instance's PD role is {self.pd.role}, not {kv_transfer.role.value}",
            )

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.get_request(request_id)
        aborted = self.scheduler.abort_request(request_id)
        if aborted:
            self.pd.aborted(request.identity)
        self._drain_if_idle()
        return aborted

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        self.scheduler.finish_request(request_id, reason)
        self._drain_if_idle()

    def take_outputs(self) -> list[RequestOutputDelta]:
        """Deltas made outside `step()` (aborts, finishes)."""
        return self._outputs()

    def _outputs(self) -> list[RequestOutputDelta]:
        pd_deltas, self._pd_deltas = self._pd_deltas, []
        return pd_deltas + self.scheduler.take_outputs()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutputDelta]:
        timings = self.timings
        t0 = time.perf_counter()
        self.pd.poll()
        scheduled = self.scheduler.schedule()
        t1 = time.perf_counter()
        pending = self.runner.submit(scheduled)
        self._inflight.append((scheduled, pending, t0, time.perf_counter()))
        self._pd_deltas.extend(self.pd.after_submit())
        t2 = time.perf_counter()
        timings.steps += 1
        timings.schedule_s += t1 - t0
        timings.submit_s += t2 - t1
        keep = 1 if self.async_scheduling and scheduled.has_work else 0
        while len(self._inflight) > keep:
            self._apply_oldest()
        self._drain_if_idle()
        if not scheduled.has_work and not self._pd_deltas:
            self.pd.idle()
        return self._outputs()

    def _drain_if_idle(self) -> None:
        """With no request left, nothing would ever collect the steps in flight: collect them
        now (their results only release device state), so an idle engine holds nothing."""
        if not self.scheduler.has_unfinished_requests():
            while self._inflight:
                self._apply_oldest()

    def _apply_oldest(self) -> None:
        scheduled, pending, scheduled_s, submitted_s = self._inflight.popleft()
        t0 = time.perf_counter()
        wait_before = self.runner.readback_wait_s
        result = self.runner.collect(pending)
        t1 = time.perf_counter()
        failed = self.pd.live_failures(result)
        self.scheduler.update_from_output(result)
        self.pd.after_collect(scheduled, result.step_failed, failed)
        t2 = time.perf_counter()
        timings = self.timings
        timings.collect_s += t1 - t0
        timings.readback_wait_s += self.runner.readback_wait_s - wait_before
        timings.update_s += t2 - t1
        timings.decode_ticks += result.decode_ticks
        device_s = device_idle_s = None
        if pending.event is not None:
            previous = self._last_event
            if previous is not None:
                device_s = previous.elapsed_time(pending.event) / 1000.0
                if pending.start_event is not None:
                    device_idle_s = previous.elapsed_time(pending.start_event) / 1000.0
            self._last_event = pending.event
        if self.step_log is not None:
            self.step_log.append(
                StepRecord(
                    scheduled.step_id,
                    scheduled.num_prefill_tokens,
                    result.decode_ticks,
                    sum(len(g.token_ids) for g in result.generated),
                    t1,
                    device_s,
                    device_idle_s,
                    scheduled_s,
                    submitted_s,
                    pending.rows,
                )
            )

    def close(self) -> None:
        """Abort every request, collect the steps in flight and drop the runner's device
        state (KV pool, rows, graphs)."""
        for request_id in self.scheduler.running_request_ids():
            self.scheduler.abort_request(request_id)
        for request_id in self.scheduler.waiting_request_ids():
            self.scheduler.abort_request(request_id)
        while self._inflight:
            self._apply_oldest()
        self.scheduler.take_outputs()
        self.pd.close()  # deregisters the memory before the runner drops it
        self.runner.close()

    # -- inspection ----------------------------------------------------------------------------
    def leak_report(self) -> list[str]:
        """Resources still held although nothing runs (empty when idle and clean): KV blocks
        held by any request, unfinished requests or steps, or device state (runner rows,
        preemption snapshots) of requests whose release is not already queued."""
        problems = []
        capacity = self.kv.capacity()
        if capacity.free_blocks != capacity.total_blocks:
            problems.append(f"KV blocks held: {capacity}")
        if self.scheduler.has_unfinished_requests():
            problems.append("unfinished requests remain")
        if self._inflight:
            problems.append(f"{len(self._inflight)} submitted steps not collected")
        stray = self.runner.held_identities() - self.scheduler.pending_releases()
        if stray:
            problems.append(f"device state without a pending release: {sorted(map(str, stray))}")
        return problems

    def stats(self) -> EngineStats:
        counters = self.scheduler.stats
        capacity = self.kv.capacity()
        return EngineStats(
            running_requests=self.scheduler.num_running,
            waiting_requests=self.scheduler.num_waiting,
            kv_blocks_total=capacity.total_blocks,
            kv_blocks_used=capacity.used_blocks,
            steps=counters.steps,
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generation_tokens,
            decode_loops=counters.decode_loops,
            finished_requests=counters.finished_requests,
            aborted_requests=counters.aborted_requests,
            preemptions=counters.preemptions,
            resumptions=counters.resumptions,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_cache_queried_tokens=self.kv.prefix_queried_tokens,
            attention_backend=self.runner.attention.capabilities.name,
            decode_cuda_graphs=self.runner.graphs is not None,
            decode_eager_reason=self.runner.graphs_disabled_reason,
            spec_drafts=counters.spec_drafts,
            spec_draft_tokens=counters.spec_draft_tokens,
            spec_accepted_tokens=counters.spec_accepted_tokens,
            spec_accepted_per_position=tuple(counters.spec_accepted_per_position),
        )

    def loop_mix(self) -> tuple[int, int]:
        """(output tokens 1.. recorded, those of them that exited before their request's
        max_loops) so far: the scheduler's host counters, read by the live statistics line."""
        counters = self.scheduler.stats
        return counters.decoded_tokens, counters.early_exit_tokens
