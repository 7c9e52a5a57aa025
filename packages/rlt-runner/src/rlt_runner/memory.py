"""KV pool sizing from a profiling run (the Worker role of the RFC): no formula reserve.

Before the KV pool exists, a throw-away runner with a tiny pool executes the heaviest shapes
the engine will ever run (README.md, "Snapshots and memory"): the largest prefill chunk, a decode
tick over every row in the most expensive sampling mode and, with speculation, a speculative
round over the most rows a round holds. Decode ticks and rounds run as CUDA graphs in one memory
pool (one replays at a time: the larger of their peaks) that stays allocated while prefill runs
eagerly next to it, so the prefill and decode peaks are added to the runner's own buffers.

The device's memory is counted as torch sees it: bytes held by live tensors are used; bytes the
caching allocator keeps but no tensor uses (e.g. left by an engine that was shut down) are free;
anything else the driver reports used (other processes, CUDA contexts) is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import (
    BlockTableUpdate,
    DecodeRule,
    ExecutionIdentity,
    ExitRule,
    ExitRuleKind,
    NewRequestData,
    PrefillChunk,
    RequestBlocks,
    SamplingParams,
    SchedulerOutput,
)
from rlt_contracts.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from rlt_contracts.structured import StructuredOutput, StructuredOutputKind


@dataclass(frozen=True)
class ActivationProfile:
    """Peak bytes above the resident state: prefill of the largest chunk, one decode tick at
    the largest batch, and the runner's persistent buffers other than the KV pool."""

    prefill_bytes: int
    decode_bytes: int
    runner_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.prefill_bytes + self.decode_bytes + self.runner_bytes

    @property
    def reserve_bytes(self) -> int:
        """What the KV budget leaves free: the total rounded up to RESERVE_GRANULE. The peaks
        move by a few hundred KiB with the allocator's history (workspaces allocated once per
        process, block reuse); rounding gives every engine built with the same options the same
        pool and leaves headroom for fragmentation."""
        return -(-self.total_bytes // RESERVE_GRANULE) * RESERVE_GRANULE


RESERVE_GRANULE = 128 << 20


@dataclass(frozen=True)
class KVMemoryPlan:
    """num_blocks: pool size; source: "explicit", "cuda_profile" or "cpu_budget";
    bytes_per_block: K+V of one block, all layers; useful_blocks: blocks that max_num_seqs
    full-context requests could ever use (the pool is never made larger); activation: the
    profile the CUDA budget subtracted (None elsewhere)."""

    num_blocks: int
    source: str
    bytes_per_block: int
    useful_blocks: int
    activation: ActivationProfile | None = None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def profile_blocks(
    prefill_tokens: int, rows: int, block_size: int, num_planes: int, lookahead: int = 0
) -> int:
    """Pool size of the profiling runner: the prefill request plus the pages of each decode
    row (a 1-token prompt and its next positions; `lookahead`: the drafts of a round)."""
    pages = -(-(prefill_tokens + 1 + lookahead) // block_size)
    pages += rows * -(-(lookahead + 2) // block_size)
    return pages * num_planes


def profile_activation_peak(
    runner, *, prefill_tokens: int, rows: int, vocab_size: int, model_depth: int
) -> ActivationProfile:
    """Run the two heaviest step shapes on `runner` (a `ModelRunner` whose pool holds
    `profile_blocks(...)` blocks) and measure their peak device bytes, on a second pass (the
    first one compiles kernels and makes one-time selections, which allocate too). CUDA only."""
    device = runner.device
    block_size = runner.block_size
    planes = runner.rows.num_planes
    speculation = runner.speculation
    drafts = speculation.num_drafts if speculation is not None else 0
    # Every sampling feature on: the decode peak includes the logits adjustments' [B, V]
    # temporaries, and the runner's lazily allocated [S, V] state (output counts, prompt and
    # stop masks, logit-bias table) exists before `persistent_bytes` is read.
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        logprobs=MAX_TOP_LOGPROBS,
        seed=0,
        max_tokens=2 + drafts,
        min_tokens=1,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={token: 0.5 for token in range(min(MAX_LOGIT_BIAS, vocab_size))},
        structured_output=StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT),
    )
    rule = DecodeRule(
        ExitRule(ExitRuleKind.HAZARD, 1, model_depth, 0.5),
        max_tokens=2 + drafts,
        num_speculative_tokens=drafts,
    )
    next_block = 0

    def request(index: int, length: int) -> tuple[NewRequestData, RequestBlocks]:
        prompt = tuple((7 * i) % vocab_size for i in range(length))
        nonlocal next_block
        identity = ExecutionIdentity(f"memory-profile-{index}", -1 - index)
        pages = -(-(length + 1 + drafts) // block_size)
        updates = []
        for plane in range(planes):
            updates.append(BlockTableUpdate(plane, 0, tuple(range(next_block, next_block + pages))))
            next_block += pages
        return NewRequestData(
            identity, params, length, rule, prompt_token_ids=prompt
        ), RequestBlocks(identity, tuple(updates))

    def peak_of(step: SchedulerOutput) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        output = runner.collect(runner.submit(step))
        if output.failures:
            messages = "; ".join(f.message for f in output.failures)
            raise RuntimeError(f"memory profiling step failed: {messages}")
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    def peak_of_first_tokens(requests, released, **work) -> int:
        """The peak of a step that runs 1-token prompts `requests` and then `work`."""
        return peak_of(
            SchedulerOutput(
                step_id=-1,
                new_requests=tuple(n for n, _ in requests),
                block_updates=tuple(b for _, b in requests),
                released=released,
                prefill=tuple(PrefillChunk(n.identity, 0, (1,), True) for n, _ in requests),
                **work,
            )
        )

    def measure() -> tuple[int, int]:
        nonlocal next_block
        big, big_blocks = request(0, prefill_tokens)
        after_big = next_block
        tokens = tuple((7 * i) % vocab_size for i in range(prefill_tokens))
        prefill = peak_of(
            SchedulerOutput(
                step_id=-2,
                new_requests=(big,),
                block_updates=(big_blocks,),
                prefill=(PrefillChunk(big.identity, 0, tokens, completes_prompt=True),),
            )
        )
        small = [request(1 + i, 1) for i in range(rows)]
        decode = peak_of_first_tokens(small, (big.identity,), decode_ticks=1)
        released = tuple(n.identity for n, _ in small)
        if speculation is not None:  # in the blocks the released decode rows held
            next_block = after_big
            count = min(rows, speculation.max_slots)
            drafting = [request(1 + rows + i, 1) for i in range(count)]
            rounds = peak_of_first_tokens(drafting, released, speculative_rounds=1)
            decode = max(decode, rounds)
            released = tuple(n.identity for n, _ in drafting)
        runner.collect(runner.submit(SchedulerOutput(step_id=0, released=released)))
        return prefill, decode

    measure()  # first pass: kernel compilation and one-time kernel selection allocate too
    next_block = 0
    prefill, decode = measure()
    return ActivationProfile(prefill, decode, runner.persistent_bytes())


def plan_kv_blocks(
    *,
    device: torch.device,
    bytes_per_block: int,
    useful_blocks: int,
    explicit_blocks: int | None,
    gpu_memory_utilization: float,
    activation: ActivationProfile | None,
    cpu_budget_bytes: int,
) -> KVMemoryPlan:
    """Size the pool. On CUDA, `gpu_memory_utilization` is this engine's share of the device, as
    in vLLM (two engines on one GPU can take 0.45 each): share x total memory, minus live tensors
    (the weights), minus the profiled activations, and never more than is free now (memory
    cached by torch's allocator but unused counts as free; other processes' use counts only
    through it). On the CPU: `cpu_budget_bytes`."""
    if explicit_blocks is not None:
        return KVMemoryPlan(explicit_blocks, "explicit", bytes_per_block, useful_blocks)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        obtainable = free + torch.cuda.memory_reserved(device) - allocated
        reserve = activation.reserve_bytes if activation is not None else 0
        budget = min(int(total * gpu_memory_utilization) - allocated, obtainable) - reserve
        source = "cuda_profile"
    else:
        budget = cpu_budget_bytes
        source = "cpu_budget"
    blocks = min(max(budget // bytes_per_block, 0), useful_blocks)
    if blocks < 1:
        raise MemoryError(
            f"no memory left for the KV cache ({budget} bytes after the weights and the "
            "profiled activations); lower max_num_batched_tokens or max_num_seqs, or raise "
            "gpu_memory_utilization"
        )
    return KVMemoryPlan(blocks, source, bytes_per_block, useful_blocks, activation)
