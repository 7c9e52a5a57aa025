"""One instance's prefix cache: prompt blocks kept after use, evicted least recently used.

Keys stand for a block's whole prefix (as the engine's chained page hashes do), so a request's
hit is the run of its leading keys present. Only prompt blocks are published, as in rlt
(`KVManager.publish_prefix`): a chat turn finds the previous turn's prompt, not its answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixCache:
    def __init__(self) -> None:
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[Hashable]) -> int:
        """Leading blocks of `keys` present; marks them used (side effect: LRU order)."""
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        return hits

    def insert(self, keys: Sequence[Hashable], capacity_blocks: int) -> None:
        """Publish `keys` as most recently used, then evict down to `capacity_blocks`."""
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        self.evict_to(capacity_blocks)

    def evict_to(self, capacity_blocks: int) -> None:
        while len(self._blocks) > max(capacity_blocks, 0):
            self._blocks.popitem(last=False)
