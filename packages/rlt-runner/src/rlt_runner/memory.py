"""KV pool sizing: how many blocks fit, and why (recorded in `KVMemoryPlan`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVMemoryPlan:
    """num_blocks: pool size; source: "explicit", "cuda_free_memory" or "cpu_budget";
    bytes_per_block: K+V of one block, all layers; useful_blocks: blocks that max_num_seqs
    full-context requests could ever use (the pool is never made larger)."""

    num_blocks: int
    source: str
    bytes_per_block: int
    useful_blocks: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_blocks(
    *,
    device: torch.device,
    bytes_per_block: int,
    useful_blocks: int,
    explicit_blocks: int | None,
    gpu_memory_utilization: float,
    activation_reserve_bytes: int,
    cpu_budget_bytes: int,
) -> KVMemoryPlan:
    """Size the pool. On CUDA: what remains of `gpu_memory_utilization` x total memory after
    the weights already loaded and an activation reserve. On the CPU: `cpu_budget_bytes`."""
    if explicit_blocks is not None:
        return KVMemoryPlan(explicit_blocks, "explicit", bytes_per_block, useful_blocks)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used - activation_reserve_bytes
        source = "cuda_free_memory"
    else:
        budget = cpu_budget_bytes
        source = "cpu_budget"
    blocks = min(max(budget // bytes_per_block, 0), useful_blocks)
    if blocks < 1:
        raise MemoryError(
            f"no memory left for the KV cache ({budget} bytes after weights and a "
            f"{activation_reserve_bytes}-byte activation reserve); lower max_num_batched_tokens or "
            "raise gpu_memory_utilization"
        )
    return KVMemoryPlan(blocks, source, bytes_per_block, useful_blocks)
