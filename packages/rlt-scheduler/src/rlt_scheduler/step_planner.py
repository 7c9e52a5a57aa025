"""`StepPlanner`: fills one step's draft (`StepBuilder`) with the work of running requests:
decode rows, prompt chunks and PD remote starts, each after `ensure_kv` made its blocks cover
what the step can write (preempting where allowed). No state of its own (R02): the draft lives
while one step is built (R03); configuration, KV port, counters and queues are `Scheduler`'s.
"""

from __future__ import annotations

from rlt_contracts import KVPort, PrefillChunk, RequestStage, SchedulerConfig

from rlt_scheduler import constrained, pd_stages, preemption
from rlt_scheduler.decode_work import DecodeWork
from rlt_scheduler.request_queues import RequestQueues
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats
from rlt_scheduler.step_builder import StepBuilder


class StepPlanner:
    """Schedules the running requests into a step draft (decode rows, prompt chunks, PD remote
    starts) and grows their KV, preempting when it must."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVPort,
        stats: SchedulerStats,
        queues: RequestQueues,
        *,
        model_depth: int,
    ) -> None:
        self.config = config
        self.kv = kv
        self.stats = stats
        self.queues = queues
        self.model_depth = model_depth

    def new_step(self) -> StepBuilder:
        """An empty draft under the configured token and loop budgets."""
        config = self.config
        return StepBuilder(
            config.max_num_batched_tokens, config.max_num_batched_token_loops, self.model_depth
        )

    def schedule_running(self, work: DecodeWork, step: StepBuilder) -> None:
        """Running requests in step-building order: decoding rows first, then running
        prefills (while prompt tokens fit), then PD remote starts whose KV landed."""
        running = self.queues.running
        for request in [r for r in running if r.stage is RequestStage.DECODING]:
            if request in running:  # not preempted while this step was being built
                self.schedule_decode(request, work, step)
        for request in [r for r in running if r.stage is RequestStage.PREFILL]:
            if request in running and step.prefill_room() > 0:
                self.schedule_prefill_chunk(request, work, step)
        for request in [r for r in running if r.stage is RequestStage.AWAITING_KV]:
            if request.kv_landed:
                self.schedule_remote_start(request, work, step)

    def schedule_decode(
        self, request: ScheduledRequest, work: DecodeWork, step: StepBuilder
    ) -> None:
        bound = constrained.decode_output_bound(request, work)
        most_outputs = request.num_outputs + request.unconfirmed_tokens + bound
        if self.ensure_kv(request, request.kv_tokens_needed(most_outputs), step, may_suspend=True):
            step.add_decode(request.identity, bound)
            constrained.send_mask_if_due(request, step)

    def schedule_prefill_chunk(
        self, request: ScheduledRequest, work: DecodeWork, step: StepBuilder
    ) -> None:
        start = request.scheduled_prompt_tokens
        count = min(
            step.prefill_room(), self.config.prefill_chunk_size, request.prompt_length - start
        )
        starts = start + count == request.prompt_length and not request.prefill_only
        if count > 0 and starts and not step.can_start_decoding():
            count -= 1  # a full speculative step: the prompt completes in a later step
        if count <= 0 or (self.config.whole_prompts and start + count < request.prompt_length):
            return  # (whole prompts wait for a step with room for all of theirs)
        completes = start + count == request.prompt_length
        # A completing chunk samples token 0, and its successor may loop in this step's ticks
        # (not on a PD prefill instance: the state is sent for the decode instance's coda).
        starts = completes and not request.prefill_only
        bound = constrained.start_output_bound(request, work) if starts else 0
        needed = max(start + count, request.kv_tokens_needed(bound)) if starts else start + count
        if not self.ensure_kv(request, needed, step, may_suspend=False):
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
        if starts:
            step.take_looping_row()
        if completes:
            request.stage = (
                RequestStage.SENDING_KV if request.prefill_only else RequestStage.DECODING
            )
        if starts:
            constrained.send_token0_mask(request, step)

    def schedule_remote_start(
        self, request: ScheduledRequest, work: DecodeWork, step: StepBuilder
    ) -> None:
        """PD decode: the prompt's KV landed; start decoding if its blocks can cover the
        step's outputs (`pd_stages.start_remote_decode`) and a speculative step has room."""
        if not step.can_start_decoding():
            return
        bound = constrained.start_output_bound(request, work)
        if not self.ensure_kv(request, request.kv_tokens_needed(bound), step, may_suspend=False):
            return
        step.take_looping_row()
        pd_stages.start_remote_decode(request, self.kv, step, bound)

    def ensure_kv(
        self, request: ScheduledRequest, num_tokens: int, step: StepBuilder, *, may_suspend: bool
    ) -> bool:
        """Blocks for positions [0, num_tokens), preempting if needed and allowed
        (`preemption.grow_or_preempt`). False: the request does not run in this step."""
        return preemption.grow_or_preempt(
            request,
            num_tokens,
            step,
            may_suspend=may_suspend,
            enable_preemption=self.config.enable_preemption,
            queues=self.queues,
            kv=self.kv,
            stats=self.stats,
        )
