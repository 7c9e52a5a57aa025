"""`EngineCore`: drives the schedule -> execute -> update loop (module M2)."""

from __future__ import annotations

from rlt_contracts import EngineStats, RequestOutputDelta
from rlt_kv import KVCacheManager
from rlt_runner import ModelRunner
from rlt_scheduler import Scheduler


class EngineCore:
    """One synchronous step at a time: the scheduler decides, the runner executes, the
    scheduler applies the results. Not thread-safe; frontends serialize access."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv

    def step(self) -> list[RequestOutputDelta]:
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        self.scheduler.update_from_output(result)
        return self.scheduler.take_outputs()

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
