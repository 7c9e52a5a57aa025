"""One engine instance, one step at a time, as rlt's scheduler runs it (coarsely).

Each step admits waiting requests (up to `max_num_seqs` rows and the KV capacity, prompt and
output reserved at admission), gives prompt chunks to admitted requests in arrival order (at
most `prefill_chunk` each, `max_batched_tokens` in all), and runs decode ticks: one tick when
the step carries prompt work (the engine's rule that keeps TTFT low), otherwise
`decode_ticks_per_step`. Every decoding row advances one loop per tick, so all rows advance
alike; a per-instance decode clock counts tokens per row (ticks / mean loops per token) and a
row finishes when the clock passes its start plus its remaining tokens: no per-row work per step.

A prompt's first token appears at the end of the step that computes its last chunk; then the
row decodes from the next step. On a prefill instance (PD) the finished prompt leaves instead
(its KV stays reserved until the copy is done); a decode instance takes landed requests, whose
first token (D runs the coda and samples it) appears at the end of the next step.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .cache import PrefixCache
from .curves import InstanceCosts
from .traces import Request


class Role(Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class EngineLimits:
    """The served engine's flags of the measured sweep, plus the simulated cache block."""

    max_num_seqs: int = 128
    max_batched_tokens: int = 4096
    prefill_chunk: int = 1024
    decode_ticks_per_step: int = 8
    kv_capacity_tokens: int = 166_976
    block_tokens: int = 128  # the engine's page is 16 positions; coarser here for speed
    prefix_caching: bool = True


@dataclass
class StepOutcome:
    finished: list[Request] = field(default_factory=list)  # last token produced
    prefilled: list[Request] = field(default_factory=list)  # PD: prompt done, ready to hand off


@dataclass
class InstanceStats:
    steps: int = 0
    busy_ms: float = 0.0
    prompt_tokens: int = 0  # admitted prompt positions
    hit_tokens: int = 0  # of which found in the prefix cache
    output_tokens: int = 0


class Instance:
    def __init__(
        self,
        index: int,
        role: Role,
        costs: InstanceCosts,
        limits: EngineLimits,
        *,
        mean_loops: float,
    ) -> None:
        self.index, self.role, self.costs, self.limits = index, role, costs, limits
        self.mean_loops = mean_loops
        self.waiting: deque[Request] = deque()
        self.stats = InstanceStats()
        self.cache = PrefixCache()
        self.busy = False
        self.kv_used_tokens = 0
        self._prefilling: list[Request] = []
        self._landed: list[Request] = []  # decode role: admitted, first token at next step end
        self._decoding: list[tuple[float, int, Request]] = []  # (finish clock, id, request)
        self._clock = 0.0  # tokens produced per decoding row since the start
        self._context_base = 0.0  # sum over decoding rows of (prompt + 1 - start clock)
        self._step: tuple[list[tuple[Request, int]], list[Request], int] | None = None

    @property
    def rows(self) -> int:
        return len(self._prefilling) + len(self._landed) + len(self._decoding)

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def start_step(self) -> float | None:
        """Plan the next step; its wall time in ms, or None when there is nothing to do."""
        self._admit()
        budget = self.limits.max_batched_tokens
        chunks: list[tuple[Request, int]] = []
        for request in self._prefilling:
            if budget <= 0:
                break
            take = min(request.prefill_remaining, self.limits.prefill_chunk, budget)
            chunks.append((request, take))
            budget -= take
        landed, self._landed = self._landed, []
        decoding = len(self._decoding)
        if not chunks and not decoding and not landed:
            return None
        prompt_tokens = sum(take for _, take in chunks)
        if decoding or landed:
            ticks = 1 if chunks else self.limits.decode_ticks_per_step
        else:
            ticks = 0
        context = self._context_base + decoding * self._clock
        context += sum(r.prompt_tokens for r in landed)
        costs = self.costs
        step_ms = costs.calibration.step_overhead_ms + costs.prefill_ms(prompt_tokens)
        step_ms += ticks * costs.tick_ms(decoding + len(landed), context)
        self._step = (chunks, landed, ticks if decoding else 0)
        self.stats.steps += 1
        self.stats.busy_ms += step_ms
        return step_ms

    def finish_step(self, now_s: float) -> StepOutcome:
        """Apply the planned step's results at its end time `now_s`."""
        assert self._step is not None, "finish_step without start_step"
        chunks, landed, ticks = self._step
        self._step = None
        outcome = StepOutcome()
        if ticks:
            self._clock += ticks / self.mean_loops
            limit = self._clock + 1e-9
            while self._decoding and self._decoding[0][0] <= limit:
                _, _, request = heapq.heappop(self._decoding)
                self._context_base -= request.prompt_tokens + 1 - request.start_clock
                self._finish(request, now_s, outcome)
        done_prefill = False
        for request, take in chunks:
            request.prefill_remaining -= take
            if request.prefill_remaining == 0:
                done_prefill = True
                if self.limits.prefix_caching:
                    self.cache.insert(request.block_keys, self._cache_capacity_blocks())
                if self.role is Role.PREFILL:
                    outcome.prefilled.append(request)
                else:
                    self._first_token(request, now_s, outcome)
        if done_prefill:
            self._prefilling = [r for r in self._prefilling if r.prefill_remaining > 0]
        for request in landed:
            self._first_token(request, now_s, outcome)
        return outcome

    def release(self, request: Request) -> None:
        """PD prefill side: the copy to D is done, the prompt's KV is free (and stays cached)."""
        self.kv_used_tokens -= request.kv_reserved

    # -- internals -------------------------------------------------------------------------------
    def _admit(self) -> None:
        limits = self.limits
        while self.waiting and self.rows < limits.max_num_seqs:
            request = self.waiting[0]
            reserve = request.prompt_tokens
            if self.role is not Role.PREFILL:
                reserve += request.output_tokens
            if self.kv_used_tokens + reserve > limits.kv_capacity_tokens and self.rows:
                return  # wait for rows to finish (an empty instance admits anything)
            self.waiting.popleft()
            self.kv_used_tokens += reserve
            request.kv_reserved = reserve
            if self.role is Role.DECODE:
                self._landed.append(request)
                continue
            hit_blocks = self.cache.match(request.block_keys) if limits.prefix_caching else 0
            # the last prompt token is always computed: its hidden state feeds the coda
            request.hit_tokens = min(hit_blocks * limits.block_tokens, request.prompt_tokens - 1)
            request.prefill_remaining = request.prompt_tokens - request.hit_tokens
            self.stats.prompt_tokens += request.prompt_tokens
            self.stats.hit_tokens += request.hit_tokens
            self._prefilling.append(request)
        if limits.prefix_caching:
            self.cache.evict_to(self._cache_capacity_blocks())

    def _cache_capacity_blocks(self) -> int:
        return (self.limits.kv_capacity_tokens - self.kv_used_tokens) // self.limits.block_tokens

    def _first_token(self, request: Request, now_s: float, outcome: StepOutcome) -> None:
        request.first_token_s = now_s
        if request.output_tokens <= 1:
            self._finish(request, now_s, outcome)
            return
        request.start_clock = self._clock
        self._context_base += request.prompt_tokens + 1 - self._clock
        finish_clock = self._clock + request.output_tokens - 1
        heapq.heappush(self._decoding, (finish_clock, request.request_id, request))

    def _finish(self, request: Request, now_s: float, outcome: StepOutcome) -> None:
        request.finish_s = now_s
        self.kv_used_tokens -= request.kv_reserved
        self.stats.output_tokens += request.output_tokens
        outcome.finished.append(request)
