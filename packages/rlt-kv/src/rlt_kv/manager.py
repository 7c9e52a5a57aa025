"""`KVCacheManager`: logical KV blocks of every request, per storage plane (module M4).

State owned here (only this class writes it): each request's block tables (one per plane),
block reference counts (via `BlockPool`), the prefix cache and its hit statistics. The
scheduler asks for allocations, growth and release through this interface; device tensors,
KV writes and copies belong to the runner (R12).

Layout: LAST_EXITED keeps T planes (one per loop depth), SHARED one, RING of K min(K, T); a
family with stage layers one more (the caller passes the count). Every plane of a
request covers the same token positions: allocating N tokens claims ceil(N / B) pages per plane.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlt_contracts import (
    NO_PREFIX,
    BlockTableUpdate,
    ExecutionIdentity,
    KVCapacity,
    PageScores,
    PrefixMatch,
)

from rlt_kv.block_pool import BlockPool
from rlt_kv.prefix_cache import PrefixCache, cacheable_pages, page_keys
from rlt_kv.score_records import DEFAULT_MAX_BYTES


@dataclass
class _Allocation:
    tables: list[list[int]]  # [plane][page] -> block id
    published_pages: int = 0  # leading pages already in (or taken from) the prefix cache


class KVCacheManager:
    """Implements `rlt_contracts.KVPort` (the scheduler's view) plus the runner-side and PD
    views below (`block_tables`, `has_allocation`, `clear_prefix_cache`)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_planes: int,
        enable_prefix_caching: bool = False,
        score_record_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """`score_record_bytes`: host memory for the prompt scores of cached pages
        (score_records.py), least recently used records dropped past it."""
        if block_size < 1 or num_planes < 1:
            raise ValueError("block_size and num_planes must be >= 1")
        self.block_size = block_size
        self.num_planes = num_planes
        self._pool = BlockPool(num_blocks)
        self._prefix = (
            PrefixCache(self._pool, score_bytes=score_record_bytes)
            if enable_prefix_caching
            else None
        )
        self._allocations: dict[ExecutionIdentity, _Allocation] = {}
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def prefix_caching(self) -> bool:
        return self._prefix is not None

    def capacity(self) -> KVCapacity:
        cached = self._prefix.evictable_blocks() if self._prefix else 0
        return KVCapacity(
            total_blocks=self._pool.num_blocks,
            free_blocks=self._pool.num_free + cached,
            cached_blocks=cached,
        )

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one request needs to hold `num_tokens` positions at every plane."""
        return self.pages_for(num_tokens) * self.num_planes

    # -- per-request views ---------------------------------------------------------------------
    def has_allocation(self, identity: ExecutionIdentity) -> bool:
        return identity in self._allocations

    def allocated_tokens(self, identity: ExecutionIdentity) -> int:
        """Positions [0, n) the request's blocks can hold (0 if it holds none)."""
        allocation = self._allocations.get(identity)
        return len(allocation.tables[0]) * self.block_size if allocation else 0

    def held_blocks(self, identity: ExecutionIdentity) -> int:
        allocation = self._allocations.get(identity)
        return sum(len(t) for t in allocation.tables) if allocation else 0

    def block_tables(self, identity: ExecutionIdentity) -> tuple[tuple[int, ...], ...]:
        """Read-only copy: per plane, the physical block of each logical page."""
        return tuple(tuple(table) for table in self._allocations[identity].tables)

    # -- prefix lookup -------------------------------------------------------------------------
    def page_keys(self, prompt_token_ids: Sequence[int], *, salt: bytes = b"") -> tuple[bytes, ...]:
        """Chained keys of the prompt's publishable full pages (those inside
        `prompt_token_ids[:-1]`) under `salt`: the keys `publish_prefix` publishes them under
        and `match_prefix` looks them up by (pure; () without a prefix cache). Two prompts
        share their first k pages under a salt iff their first k keys are equal."""
        if self._prefix is None:
            return ()
        num_pages = cacheable_pages(len(prompt_token_ids), len(prompt_token_ids), self.block_size)
        return tuple(page_keys(prompt_token_ids, self.block_size, num_pages, salt=salt))

    def match_prefix(
        self,
        prompt_token_ids: Sequence[int],
        *,
        salt: bytes = b"",
        score_top_n: int | None = None,
    ) -> PrefixMatch:
        """Leading full pages of `prompt_token_ids[:-1]` found in the prefix cache under `salt`
        (pure). With `score_top_n` (a scored prompt) the run stops at the first page without a
        score record for this prompt's next token with at least that many alternatives."""
        if self._prefix is None:
            return NO_PREFIX
        num_pages = cacheable_pages(len(prompt_token_ids), len(prompt_token_ids), self.block_size)
        keys = page_keys(prompt_token_ids, self.block_size, num_pages, salt=salt)
        blocks = self._prefix.lookup(keys)
        scores: list[PageScores] = []
        if score_top_n is not None:
            for page in range(len(blocks)):
                next_token = prompt_token_ids[(page + 1) * self.block_size]
                record = self._prefix.scores.get(keys[page], next_token, score_top_n)
                if record is None:
                    break
                scores.append(record)
            blocks = blocks[: len(scores)]
        claim = sum(len(page) for page in blocks if all(self._pool.refs(b) == 1 for b in page))
        return PrefixMatch(
            keys=tuple(keys[: len(blocks)]),
            blocks=tuple(blocks),
            num_tokens=len(blocks) * self.block_size,
            cached_claim_blocks=claim,
            scores=tuple(scores),
        )

    # -- allocation ----------------------------------------------------------------------------
    def allocate(
        self,
        identity: ExecutionIdentity,
        num_tokens: int,
        prefix: PrefixMatch = NO_PREFIX,
        *,
        prompt_length: int = 0,
    ) -> tuple[BlockTableUpdate, ...] | None:
        """Claim blocks for positions [0, num_tokens) at every plane, reusing `prefix` pages.

        Returns the new tables as updates, or None (nothing changed) if the pool cannot supply
        the fresh blocks even after evicting unreferenced prefix pages. Side effects on
        success: prefix pages gain a reference and move to the LRU tail; hit counters advance
        by `prompt_length` queried / `prefix.num_tokens` hit tokens.
        """
        if identity in self._allocations:
            raise RuntimeError(f"{identity} already holds KV blocks")
        reused_pages = len(prefix.blocks)
        fresh_pages = max(self.pages_for(num_tokens) - reused_pages, 0)
        fresh = self._claim(fresh_pages * self.num_planes, pinned=prefix.blocks)
        if fresh is None:
            return None
        tables: list[list[int]] = [[] for _ in range(self.num_planes)]
        for page in prefix.blocks:
            for plane, block in enumerate(page):
                self._pool.add_ref(block)
                tables[plane].append(block)
        for plane, run in enumerate(_plane_runs(fresh, fresh_pages, self.num_planes)):
            tables[plane].extend(run)
        self._allocations[identity] = _Allocation(tables, published_pages=reused_pages)
        if self._prefix is not None:
            self._prefix.touch(prefix.keys)
            self.prefix_queried_tokens += prompt_length
            self.prefix_hit_tokens += prefix.num_tokens
        return tuple(
            BlockTableUpdate(plane=plane, first_page=0, block_ids=tuple(table))
            for plane, table in enumerate(tables)
        )

    def grow(
        self, identity: ExecutionIdentity, num_tokens: int
    ) -> tuple[BlockTableUpdate, ...] | None:
        """Extend every plane to hold positions [0, num_tokens). Returns the appended blocks
        (empty if nothing was needed) or None if the pool cannot supply them (no change)."""
        allocation = self._allocations[identity]
        have = len(allocation.tables[0])
        missing = self.pages_for(num_tokens) - have
        if missing <= 0:
            return ()
        fresh = self._claim(missing * self.num_planes)
        if fresh is None:
            return None
        updates = []
        for plane, new in enumerate(_plane_runs(fresh, missing, self.num_planes)):
            table = allocation.tables[plane]
            table.extend(new)
            updates.append(BlockTableUpdate(plane=plane, first_page=have, block_ids=tuple(new)))
        return tuple(updates)

    def free(self, identity: ExecutionIdentity) -> None:
        """Return the request's blocks (shared prefix pages stay cached). Idempotent."""
        allocation = self._allocations.pop(identity, None)
        if allocation is not None:
            self._pool.release([b for table in allocation.tables for b in table])

    # -- prefix publication --------------------------------------------------------------------
    def publish_prefix(
        self,
        identity: ExecutionIdentity,
        prompt_token_ids: Sequence[int],
        computed_tokens: int,
        *,
        salt: bytes = b"",
        page_scores: Callable[[int, int], PageScores] | None = None,
    ) -> int:
        """Publish the request's full prompt pages now written at every plane and layer, under
        `salt` (the same the request's `match_prefix` used).

        Call only with completion evidence: `computed_tokens` prompt positions are known to be
        written (e.g. reported by the runner after the step). With `page_scores`, each page this
        call covers keeps `page_scores(start, end)`, the scores of its positions [start, end),
        also when the page was already cached by another request (a plain prompt caches KV
        without scores). Returns pages newly published.
        """
        if self._prefix is None:
            return 0
        allocation = self._allocations[identity]
        ready = cacheable_pages(len(prompt_token_ids), computed_tokens, self.block_size)
        if ready <= allocation.published_pages:
            return 0
        keys = page_keys(prompt_token_ids, self.block_size, ready, salt=salt)
        published = 0
        for page in range(allocation.published_pages, ready):
            blocks = tuple(table[page] for table in allocation.tables)
            if not self._prefix.contains(keys[page]):
                self._prefix.insert(keys[page], blocks)
                published += 1
            if page_scores is not None:
                start, end = page * self.block_size, (page + 1) * self.block_size
                self._prefix.scores.put(keys[page], prompt_token_ids[end], page_scores(start, end))
        allocation.published_pages = ready
        return published

    def clear_prefix_cache(self) -> None:
        if self._prefix is not None:
            self._prefix.clear()

    # -- internals -----------------------------------------------------------------------------
    def _claim(self, count: int, pinned: Sequence[tuple[int, ...]] = ()) -> list[int] | None:
        """`count` fresh blocks, evicting unreferenced prefix pages if needed; None if impossible.

        `pinned` pages (about to be reused) are never evicted to make room.
        """
        shortfall = count - self._pool.num_free
        if shortfall > 0:
            if self._prefix is None:
                return None
            for page in pinned:  # hold them while evicting
                for block in page:
                    self._pool.add_ref(block)
            try:
                if self._prefix.evict(shortfall) < shortfall:
                    return None
            finally:
                for page in pinned:
                    self._pool.release(list(page))
        return self._pool.take(count)


def _plane_runs(fresh: list[int], pages: int, num_planes: int) -> list[list[int]]:
    """Split `pages * num_planes` fresh blocks into one ascending run per plane.

    Sorted and sliced, each plane's new pages are consecutive block ids wherever the free list
    allows (all of them in a fresh pool). A PD handoff merges pages that are contiguous on
    both instances into one transfer descriptor per (tensor, layer): interleaving the planes
    block by block would make every page of every layer a descriptor of its own (6144 for a
    512-token prompt of Ouro-1.4B's shape instead of 48, see packages/rlt-pd/README.md).
    """
    ordered = sorted(fresh)
    return [ordered[plane * pages : (plane + 1) * pages] for plane in range(num_planes)]
