"""Content-addressed cache of full prompt pages, shared across requests at every plane
(README.md, "Prefix cache"): page i is keyed by a chained SHA-256, key_i = H(key_{i-1} ||
tokens of page i as little-endian int64), started from another root under a salt; an entry
holds one block per plane and one reference on each, and its score records go with it.
Unreferenced entries are evicted oldest-first (LRU). Only pages inside `prompt[:-1]` are
published: the final prompt token's hidden state, which the cache does not keep, feeds coda.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from rlt_kv.block_pool import BlockPool
from rlt_kv.score_records import DEFAULT_MAX_BYTES, ScoreRecords

PageKey = bytes
_ROOT = b"rlt-prefix-v1"


def page_keys(
    token_ids: Sequence[int], block_size: int, num_pages: int, *, salt: bytes = b""
) -> list[PageKey]:
    """Chained keys of the first `num_pages` full pages of `token_ids` (under `salt`)."""
    keys = []
    previous = hashlib.sha256(_ROOT + b"/" + salt).digest() if salt else _ROOT
    for page in range(num_pages):
        tokens = token_ids[page * block_size : (page + 1) * block_size]
        digest = hashlib.sha256(previous)
        digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
        previous = digest.digest()
        keys.append(previous)
    return keys


def cacheable_pages(prompt_length: int, computed_tokens: int, block_size: int) -> int:
    """Full pages publishable once `computed_tokens` prompt positions exist at every plane."""
    return min(computed_tokens, prompt_length - 1) // block_size


class PrefixCache:
    """Key -> per-plane block ids of one page. Holds one pool reference per cached block, and
    the pages' score records (`scores`, bounded by `score_bytes`)."""

    def __init__(self, pool: BlockPool, *, score_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._pool = pool
        self._entries: OrderedDict[PageKey, tuple[int, ...]] = OrderedDict()
        self.scores = ScoreRecords(score_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[PageKey]) -> list[tuple[int, ...]]:
        """Blocks of the longest cached run of leading pages. Pure: no LRU or refcount change."""
        found = []
        for key in keys:
            blocks = self._entries.get(key)
            if blocks is None:
                break
            found.append(blocks)
        return found

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark entries as just used (most recent last in LRU order)."""
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.scores.touch(key)

    def contains(self, key: PageKey) -> bool:
        return key in self._entries

    def insert(self, key: PageKey, blocks: tuple[int, ...]) -> None:
        """Publish `blocks` (already written at every plane) under `key`; takes a reference."""
        if key in self._entries:
            return
        for block in blocks:
            self._pool.add_ref(block)
        self._entries[key] = blocks

    def evictable_blocks(self) -> int:
        """Blocks that only the cache references (free after eviction)."""
        return sum(
            len(blocks)
            for blocks in self._entries.values()
            if all(self._pool.refs(b) == 1 for b in blocks)
        )

    def evict(self, num_blocks: int) -> int:
        """Evict unreferenced entries, oldest first, until `num_blocks` blocks are freed.

        Evicts nothing unless enough blocks can be freed (a failed claim leaves the cache
        intact). Returns the number of blocks freed.
        """
        victims, freed = [], 0
        for key, blocks in self._entries.items():
            if freed >= num_blocks:
                break
            if all(self._pool.refs(b) == 1 for b in blocks):
                victims.append(key)
                freed += len(blocks)
        if freed < num_blocks:
            return 0
        for key in victims:
            self._pool.release(list(self._entries.pop(key)))
            self.scores.drop_page(key)
        return freed

    def clear(self) -> None:
        for blocks in self._entries.values():
            self._pool.release(list(blocks))
        self._entries.clear()
        self.scores.clear()
