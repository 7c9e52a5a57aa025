"""What the KV pool holds for the chosen layout and loop cap: the start-up log's numbers.

A token position keeps one block slot on every plane: the layout's loop planes at the loop cap
(`KVLayoutSpec.storage_planes`: last_exited the cap, shared one, ring:K min(K, cap)) plus the
family's stage plane (prelude and coda layers), whatever depth a request runs. So a full-length
request (max_model_len positions at the cap) holds ceil(max_model_len / block_size) pages on
every plane, and the pool fits num_blocks // (pages x planes) of them at once.

Worked example (Huginn-0125's release shape, bf16, block 16, max_model_len 1,152 = 72 pages, cap
32): a block is 4 layer slots x 16 positions x K + V x 5,280 x 2 B = 1,351,680 B; last_exited
keeps 32 + 1 planes (2.8 MB per position, 72 x 33 = 2,376 blocks a request), ring:8 keeps
8 + 1 (0.76 MB, 648 blocks): in the same pool ring:8 fits 33 / 9 = 3.7 times the requests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVPoolCapacity:
    """layout: the layout's name ("ring:8"); loop_planes / stage_planes: planes per position;
    bytes_per_token: one position's K and V over all planes and layers; tokens: positions the
    pool holds on every plane; full_length_requests: requests of `max_model_len` tokens that fit
    at once; max_model_len: the context length they are counted at."""

    layout: str
    loop_planes: int
    stage_planes: int
    bytes_per_token: int
    tokens: int
    full_length_requests: int
    max_model_len: int

    @property
    def planes(self) -> int:
        return self.loop_planes + self.stage_planes

    def describe(self) -> str:
        """The start-up log's words for it."""
        stage = f" + {self.stage_planes} stage" if self.stage_planes else ""
        return (
            f"kv_layout {self.layout}: {self.loop_planes} loop{stage} plane(s), "
            f"{self.bytes_per_token:,} bytes per token; {self.full_length_requests} requests of "
            f"max_model_len {self.max_model_len} fit at once"
        )


def kv_pool_capacity(
    *,
    layout: str,
    loop_planes: int,
    stage_planes: int,
    num_blocks: int,
    block_size: int,
    bytes_per_block: int,
    max_model_len: int,
) -> KVPoolCapacity:
    """The capacity of a pool of `num_blocks` blocks of `block_size` positions (one plane,
    every layer, `bytes_per_block` bytes each) under a layout keeping these planes."""
    planes = loop_planes + stage_planes
    pages_per_request = -(-max_model_len // block_size)
    return KVPoolCapacity(
        layout=layout,
        loop_planes=loop_planes,
        stage_planes=stage_planes,
        bytes_per_token=bytes_per_block * planes // block_size,
        tokens=num_blocks // planes * block_size,
        full_length_requests=num_blocks // (pages_per_request * planes),
        max_model_len=max_model_len,
    )
