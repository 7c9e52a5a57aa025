"""Test harness: a counting KV port and a scripted device, so scheduler tests need no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlt_contracts import (
    NO_PREFIX,
    BlockTableUpdate,
    ExecutionIdentity,
    GeneratedTokens,
    KVCapacity,
    ModelRunnerOutput,
    PrefillProgress,
    PromptLogprobs,
    SchedulerConfig,
    SchedulerOutput,
    SpeculationConfig,
)
from rlt_scheduler import Scheduler


class CountingKV:
    """Implements the scheduler's KV port by counting pages per request (no block ids)."""

    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks, self.block_size, self.num_planes = num_blocks, block_size, num_planes
        self.pages: dict[ExecutionIdentity, int] = {}

    def capacity(self) -> KVCapacity:
        used = sum(self.pages.values()) * self.num_planes
        return KVCapacity(self.num_blocks, self.num_blocks - used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.num_planes

    def held_blocks(self, identity) -> int:
        return self.pages.get(identity, 0) * self.num_planes

    def allocated_tokens(self, identity) -> int:
        return self.pages.get(identity, 0) * self.block_size

    def page_keys(self, prompt, *, salt=b""):
        return ()  # no prefix cache

    def match_prefix(self, prompt, *, salt=b"", score_top_n=None):
        return NO_PREFIX

    def allocate(self, identity, num_tokens, prefix, *, prompt_length=0):
        pages = -(-num_tokens // self.block_size)
        if pages * self.num_planes > self.capacity().free_blocks:
            return None
        self.pages[identity] = pages
        return (BlockTableUpdate(0, 0, tuple(range(pages))),)

    def grow(self, identity, num_tokens):
        pages = -(-num_tokens // self.block_size)
        extra = pages - self.pages[identity]
        if extra <= 0:
            return ()
        if extra * self.num_planes > self.capacity().free_blocks:
            return None
        first = self.pages[identity]
        self.pages[identity] = pages
        return (BlockTableUpdate(0, first, tuple(range(first, pages))),)

    def free(self, identity):
        self.pages.pop(identity, None)

    def publish_prefix(self, identity, prompt, computed, *, salt=b"", page_scores=None):
        return 0


DepthFn = Callable[[str, int], int]  # (request_id, output index) -> exit depth of that token


@dataclass
class _Row:
    prompt_length: int
    max_tokens: int
    stop_ids: tuple[int, ...]
    outputs: int = 0
    loops: int = 0
    active: bool = False


@dataclass
class FakeDevice:
    """Plays the runner: prompt chunks, token 0 at full depth, then per tick one loop per
    active row; a token exits after depth(request_id, output index) loops. Every tick checks
    that the looping position is covered by the request's blocks. A speculative round accepts
    every draft (`accepts`; else none): a row emits its drafts + 1 tokens (or 1; drafts capped
    so that they fit max_tokens), after checking that the positions it writes (p .. p +
    drafts) are covered."""

    kv: CountingKV
    depth: DepthFn
    token: Callable[[str, int], int] = lambda request_id, index: 7
    model_depth: int = 4
    rows: dict[ExecutionIdentity, _Row] = field(default_factory=dict)
    saved: dict[ExecutionIdentity, _Row] = field(default_factory=dict)
    ticks_run: list[int] = field(default_factory=list)
    drafts: dict[ExecutionIdentity, int] = field(default_factory=dict)
    accepts: bool = True
    scored: dict[ExecutionIdentity, tuple[int, bool]] = field(default_factory=dict)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for identity in step.snapshots:
            self.saved[identity] = self.rows.pop(identity)
        for identity in step.released:
            self.rows.pop(identity, None)
            self.saved.pop(identity, None)
        for identity in step.restores:
            self.rows[identity] = self.saved.pop(identity)
        for new in step.new_requests:
            rule = new.rule
            self.rows[new.identity] = _Row(new.prompt_length, rule.max_tokens, rule.stop_token_ids)
            self.drafts[new.identity] = rule.num_speculative_tokens
            if new.sampling.prompt_logprobs is not None:
                self.scored[new.identity] = (
                    new.sampling.prompt_logprobs,
                    new.sampling.score_at_exit_depth,
                )
        made: dict[ExecutionIdentity, list[tuple[int, int]]] = {}
        for chunk in step.prefill:
            if chunk.completes_prompt:
                self._emit(chunk.identity, self.model_depth, made)
        for _ in range(step.decode_ticks):
            for identity, row in self.rows.items():
                if not row.active:
                    continue
                position = row.prompt_length + row.outputs - 1
                assert position < self.kv.allocated_tokens(identity), "tick outside its blocks"
                row.loops += 1
                if row.loops >= self.depth(identity.request_id, row.outputs):
                    self._emit(identity, row.loops, made)
        for _ in range(step.speculative_rounds):
            for identity, row in self.rows.items():
                if not row.active:
                    continue
                drafted = min(self.drafts[identity], row.max_tokens - row.outputs - 1)
                last = row.prompt_length + row.outputs - 1 + drafted
                assert last < self.kv.allocated_tokens(identity), "round outside its blocks"
                for _ in range(drafted + 1 if self.accepts else 1):
                    if row.active:
                        self._emit(identity, self.depth(identity.request_id, row.outputs), made)
        self.ticks_run.append(step.decode_ticks)
        return ModelRunnerOutput(
            step_id=step.step_id,
            prefill_progress=tuple(
                PrefillProgress(c.identity, c.end_position) for c in step.prefill
            ),
            generated=tuple(
                GeneratedTokens(
                    identity=identity,
                    first_output_index=(
                        self.rows[identity].outputs - len(tokens) if identity in self.rows else 0
                    ),
                    token_ids=tuple(t for t, _ in tokens),
                    exit_depths=tuple(d for _, d in tokens),
                )
                for identity, tokens in made.items()
            ),
            decode_ticks=step.decode_ticks,
            speculative_rounds=step.speculative_rounds,
            prompt_logprobs=tuple(
                self._scores(c) for c in step.prefill if c.identity in self.scored
            ),
        )

    def _scores(self, chunk) -> PromptLogprobs:
        """Scores of a scored prompt's chunk: position p scores token p + 1 with
        log-probability -(p + 1) / 8, rank p + 1, top-n ids p*10 + k and exit depth 2."""
        top, at_exit = self.scored[chunk.identity]
        end = min(chunk.end_position, self.rows[chunk.identity].prompt_length - 1)
        positions = range(chunk.start_position, end)
        return PromptLogprobs(
            chunk.identity,
            chunk.start_position + 1,
            tuple(-(p + 1) / 8 for p in positions),
            tuple(p + 1 for p in positions),
            tuple(tuple((p * 10 + k, -k / 2) for k in range(top)) for p in positions),
            exit_depths=tuple(2 for _ in positions) if at_exit else (),
        )

    def _emit(self, identity, depth, made) -> None:
        row = self.rows[identity]
        token = self.token(identity.request_id, row.outputs)
        made.setdefault(identity, []).append((token, depth))
        row.outputs += 1
        row.loops = 0
        row.active = not (token in row.stop_ids or row.outputs >= row.max_tokens)


def make_scheduler(
    *,
    depth: int = 4,
    num_blocks: int = 1000,
    num_speculative_tokens: int = 0,
    speculative_disable_batch_size: int | None = None,
    **config,
) -> Scheduler:
    speculation = SpeculationConfig(
        num_tokens=num_speculative_tokens, disable_batch_size=speculative_disable_batch_size
    )
    return Scheduler(
        SchedulerConfig(**config),
        CountingKV(num_blocks, 4, depth),
        model_depth=depth,
        vocab_size=1000,
        max_model_len=4096,
        eos_token_ids=(0,),
        speculation=speculation,
    )


def run_until_idle(scheduler: Scheduler, device: FakeDevice, *, in_flight: int = 1):
    """Drive the scheduler like the asynchronous engine: up to `in_flight` submitted steps wait
    while the next one is scheduled. Returns (steps, deltas by request id)."""
    steps, finals, pending = [], {}, []
    for _ in range(1000):
        if not scheduler.has_unfinished_requests() and not pending:
            break
        step = scheduler.schedule()
        steps.append(step)
        pending.append(device.execute(step))
        while len(pending) > (in_flight if step.has_work else 0):
            scheduler.update_from_output(pending.pop(0))
        for delta in scheduler.take_outputs():
            finals.setdefault(delta.request_id, []).append(delta)
    return steps, finals
