"""Test harness: a counting KV port and a scripted runner, so scheduler tests need no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlt_contracts import (
    BlockTableUpdate,
    ExecutionIdentity,
    GateSignal,
    KVCapacity,
    ModelRunnerOutput,
    PrefillProgress,
    SampledToken,
    SchedulerOutput,
)
from rlt_scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class NoPrefix:
    num_tokens: int = 0
    num_blocks: int = 0
    cached_claim_blocks: int = 0


class CountingKV:
    """Implements the scheduler's KV port by counting blocks (no block ids matter here)."""

    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks, self.block_size, self.num_planes = num_blocks, block_size, num_planes
        self.held: dict[ExecutionIdentity, int] = {}

    def capacity(self) -> KVCapacity:
        return KVCapacity(self.num_blocks, self.num_blocks - sum(self.held.values()))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.num_planes

    def held_blocks(self, identity) -> int:
        return self.held.get(identity, 0)

    def allocated_tokens(self, identity) -> int:
        return self.held.get(identity, 0) // self.num_planes * self.block_size

    def match_prefix(self, prompt):
        return NoPrefix()

    def allocate(self, identity, num_tokens, prefix, *, prompt_length=0):
        need = self.blocks_for(num_tokens)
        if need > self.capacity().free_blocks:
            return None
        self.held[identity] = need
        return (BlockTableUpdate(0, 0, tuple(range(need))),)

    def grow(self, identity, num_tokens):
        return ()

    def free(self, identity):
        self.held.pop(identity, None)

    def publish_prefix(self, identity, prompt, computed):
        return 0


GateFn = Callable[[str, int], float]  # (request_id, loop_index) -> exit probability


def make_scheduler(*, depth: int = 4, num_blocks: int = 1000, **config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**config),
        CountingKV(num_blocks, 4, depth),
        model_depth=depth,
        vocab_size=1000,
        max_model_len=4096,
        eos_token_ids=(0,),
    )


def fake_execute(step: SchedulerOutput, gate: GateFn, token: int = 7) -> ModelRunnerOutput:
    """What a runner would report: progress for chunks, a token per coda, a gate per loop."""
    return ModelRunnerOutput(
        step_id=step.step_id,
        prefill_progress=tuple(PrefillProgress(c.identity, c.end_position) for c in step.prefill),
        sampled_tokens=tuple(SampledToken(i.identity, i.output_index, token) for i in step.coda),
        gate_signals=tuple(
            GateSignal(
                i.identity, i.position, i.loop_index, gate(i.identity.request_id, i.loop_index)
            )
            for i in step.decode
        )
        if step.compute_gates
        else (),
    )


def run_until_idle(scheduler: Scheduler, gate: GateFn, max_steps: int = 500):
    """Drive the scheduler; returns (steps, final deltas by request id)."""
    steps, finals = [], {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step = scheduler.schedule()
        steps.append(step)
        scheduler.update_from_output(fake_execute(step, gate))
        for delta in scheduler.take_outputs():
            finals.setdefault(delta.request_id, []).append(delta)
    return steps, finals
