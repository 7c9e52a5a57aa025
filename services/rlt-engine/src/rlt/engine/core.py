"""`EngineCore`: drives the schedule -> execute -> update loop (module M2)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlt_contracts import EngineStats, RequestOutputDelta
from rlt_kv import KVCacheManager
from rlt_runner import ModelRunner
from rlt_scheduler import Scheduler


@dataclass
class StepTimings:
    """Cumulative wall-clock seconds of the engine loop's phases (host clock).

    execute_s includes `readback_wait_s`, the time the host blocked on device results; the rest
    of a step is host work (scheduling, batch preparation, kernel launches, result handling).
    """

    steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    readback_wait_s: float = 0.0
    update_s: float = 0.0

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.execute_s - self.readback_wait_s + self.update_s

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.update_s


class EngineCore:
    """One synchronous step at a time: the scheduler decides, the runner executes, the
    scheduler applies the results. Not thread-safe; frontends serialize access."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.timings = StepTimings()

    def step(self) -> list[RequestOutputDelta]:
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(scheduled)
        t2 = time.perf_counter()
        self.scheduler.update_from_output(result)
        deltas = self.scheduler.take_outputs()
        t3 = time.perf_counter()
        timings = self.timings
        timings.steps += 1
        timings.schedule_s += t1 - t0
        timings.execute_s += t2 - t1
        timings.update_s += t3 - t2
        timings.readback_wait_s = self.runner.readback_wait_s
        return deltas

    def leak_report(self) -> list[str]:
        """Resources still held although nothing runs (empty when idle and clean): KV blocks
        held by any request, unfinished requests, or device state (runner slots, preemption
        snapshots) of requests whose release is not already queued for the next step."""
        problems = []
        capacity = self.kv.capacity()
        if capacity.free_blocks != capacity.total_blocks:
            problems.append(f"KV blocks held: {capacity}")
        if self.scheduler.has_unfinished_requests():
            problems.append("unfinished requests remain")
        stray = self.runner.held_identities() - self.scheduler.pending_releases()
        if stray:
            problems.append(f"device state without a pending release: {sorted(stray)}")
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
        )
