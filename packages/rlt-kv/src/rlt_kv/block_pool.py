"""`BlockPool`: physical KV block ids, their reference counts and the free list."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out physical block ids 0..num_blocks-1 and takes them back when unreferenced.

    A block is referenced by every request whose block table holds it (and, with prefix caching,
    by the cache entry that publishes it). Only the KV manager writes these counts.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    def take(self, count: int) -> list[int]:
        """`count` fresh blocks, each with one reference. The caller checks `num_free` first."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def add_ref(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            raise RuntimeError(f"block {block_id} is free; it cannot gain a reference")
        self._refs[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list."""
        for block in block_ids:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} released more often than referenced")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
