"""Logical KV-cache contracts: layouts, capacity views, admission plans, prefix matches, the
score records kept with cached prompt pages and the `KVPort` the scheduler allocates through
(all implemented by rlt-kv)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from rlt_contracts.requests import ExecutionIdentity


class KVLayout(enum.StrEnum):
    """How KV entries are kept across loop depths (the kind; `KVLayoutSpec` adds a ring's size).

    LAST_EXITED  one storage plane per loop depth. A token that exits at depth e gets its depth-e
                 KV copied into the deeper planes e+1..T-1, so a later query at loop d reads the
                 version min(d, e). With threshold 1.0 this equals the per-depth KV of the
                 Hugging Face reference.
    SHARED       one plane, overwritten by every loop; later tokens read each earlier token's final
                 version at every depth. Uses 1/T of the memory but changes model semantics.
    RING         K planes (`KVLayoutSpec.ring_planes`, "ring:K"): loop i reads and writes plane
                 (i - 1) mod K, so a plane holds the latest of its loops that ran (approximate when
                 K < T: Huginn's KV sharing, the authors' `compress-s`). See `KVLayoutSpec`.
    """

    LAST_EXITED = "last_exited"
    SHARED = "shared"
    RING = "ring"

    def storage_planes(self, model_depth: int) -> int:
        """Number of physical KV planes one token position occupies (RING: see KVLayoutSpec)."""
        if self is KVLayout.RING:
            raise ValueError("a ring's planes depend on its size: use KVLayoutSpec")
        return model_depth if self is KVLayout.LAST_EXITED else 1

    def plane_of_loop(self, loop_index: int) -> int:
        """Plane (0-based) that loop `loop_index` (1-based) reads and writes."""
        if self is KVLayout.RING:
            raise ValueError("a ring's planes depend on its size: use KVLayoutSpec")
        return loop_index - 1 if self is KVLayout.LAST_EXITED else 0


class KVLayoutSpec(msgspec.Struct, frozen=True):
    """A KV layout with its parameters: what `parse_kv_layout` returns and the runner keeps.

    kind: the `KVLayout`; ring_planes: K for RING ("ring:K", K >= 1), 0 otherwise.

    RING, in full: loop i (1-based) of a token reads and writes plane (i - 1) mod K of the
    recurrent layers (a family's prelude / coda layers keep their one stage plane), so a query
    at loop i reads, of every earlier position, the latest of that position's loops j with
    j = i (mod K) that ran. Nothing is copied when a token exits at loop e >= K (every plane
    then holds one of its loops); a token that stops at e < K has never written planes
    e..K-1, and those get its loop-e KV (as LAST_EXITED's copy), so no query ever reads a
    plane its position did not fill (a freed block's stale KV). Hence with K >= T (the loop
    cap) RING is LAST_EXITED exactly. With K < T the result depends on which loops ran
    (`folds_loops`): a prompt is computed as one block, loop by loop (each prompt position
    at loop i reads the others' loop-i KV, then the ring keeps the latest), so prompts are not
    chunked and prefix-cache hits would differ from misses (the engine refuses them).

    Worked example, ring:2, T = 4: loops 1, 2, 3, 4 use planes 0, 1, 0, 1; after a token ran
    4 loops its plane 0 holds loop 3's KV and plane 1 loop 4's; a later token at loop 1 reads
    loop 3's, at loop 2 loop 4's. A token that exited at loop 1 has plane 1 filled with its
    loop-1 KV.
    """

    kind: KVLayout
    ring_planes: int = 0

    def __post_init__(self) -> None:
        if (self.kind is KVLayout.RING) != (self.ring_planes > 0) or self.ring_planes < 0:
            raise ValueError(
                f"ring_planes must be >= 1 for a ring and 0 otherwise, got {self.kind.value} "
                f"with {self.ring_planes}"
            )

    @property
    def value(self) -> str:
        """The layout's name as options spell it: "last_exited", "shared", "ring:8"."""
        if self.kind is KVLayout.RING:
            return f"{self.kind.value}:{self.ring_planes}"
        return self.kind.value

    def __str__(self) -> str:
        return self.value

    def storage_planes(self, model_depth: int) -> int:
        """Physical KV planes of the recurrent layers per token position (a ring larger than
        the depth keeps only the planes a loop can reach)."""
        if self.kind is KVLayout.RING:
            return min(self.ring_planes, model_depth)
        return self.kind.storage_planes(model_depth)

    def plane_of_loop(self, loop_index):
        """Plane (0-based) that loop `loop_index` (1-based) reads and writes: an int, or an
        int64 tensor of loop indices (elementwise)."""
        if self.kind is KVLayout.RING:
            return (loop_index - 1) % self.ring_planes
        if self.kind is KVLayout.LAST_EXITED:
            return loop_index - 1
        return loop_index * 0

    @property
    def fills_unreached_planes(self) -> bool:
        """A token that stops at loop e gets its loop-e KV copied into the planes it did not
        reach (LAST_EXITED: e..T-1; RING: e..K-1 when e < K; SHARED: none)."""
        return self.kind is not KVLayout.SHARED

    def folds_loops(self, model_depth: int) -> bool:
        """Several loops share a plane of the recurrent layers, so the KV a position leaves
        depends on which loops it ran: RING with K below the depth (SHARED is handled apart:
        its prompts run position by position)."""
        return self.kind is KVLayout.RING and self.ring_planes < model_depth


RING_PREFIX = "ring:"


def parse_kv_layout(text: str | KVLayout | KVLayoutSpec) -> KVLayoutSpec:
    """The one parser of a KV layout option: "last_exited", "shared" or "ring:K" (K >= 1, a
    decimal integer); a `KVLayout` of another kind or a spec passes through. ValueError, with
    the accepted forms, otherwise."""
    if isinstance(text, KVLayoutSpec):
        return text
    if isinstance(text, KVLayout) and text is not KVLayout.RING:
        return KVLayoutSpec(text)
    accepted = "'last_exited', 'shared' or 'ring:K' (K >= 1 planes, e.g. 'ring:8')"
    if not isinstance(text, str):
        raise ValueError(f"must be {accepted}, got {text!r}")
    if text.startswith(RING_PREFIX):
        size = text[len(RING_PREFIX) :]
        if not (size.isascii() and size.isdigit() and int(size) >= 1):
            raise ValueError(f"a ring needs K >= 1 planes: must be {accepted}, got {text!r}")
        return KVLayoutSpec(KVLayout.RING, int(size))
    if text in (KVLayout.LAST_EXITED.value, KVLayout.SHARED.value):
        return KVLayoutSpec(KVLayout(text))
    raise ValueError(f"must be {accepted}, got {text!r}")


class KVCapacity(msgspec.Struct, frozen=True):
    """Pool-wide block counts at one instant. One block = `block_size` token positions of one
    plane, all layers, K and V.

    total_blocks: blocks in the pool.
    free_blocks: blocks no request holds (includes evictable prefix-cache blocks).
    cached_blocks: blocks held only by the prefix cache (evictable, counted in free_blocks).
    """

    total_blocks: int
    free_blocks: int
    cached_blocks: int = 0

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


class AdmissionPlan(msgspec.Struct, frozen=True):
    """The block budget of admitting one request, in blocks (not tokens).

    required_blocks: new blocks the request must claim now (its demand minus reused prefix).
    reserved_growth_blocks: blocks kept back for the future growth of already running requests.
    headroom_blocks: watermark blocks kept free while other requests run.
    cached_claim_blocks: evictable prefix-cache blocks this request would pin (not free after).
    reusable_prefix_tokens: prompt tokens whose KV is reused from the prefix cache.
    """

    required_blocks: int
    reserved_growth_blocks: int
    headroom_blocks: int
    cached_claim_blocks: int = 0
    reusable_prefix_tokens: int = 0

    @property
    def total_cost_blocks(self) -> int:
        return (
            self.required_blocks
            + self.reserved_growth_blocks
            + self.headroom_blocks
            + self.cached_claim_blocks
        )

    def fits(self, free_blocks: int) -> bool:
        return self.total_cost_blocks <= free_blocks


class BlockTableUpdate(msgspec.Struct, frozen=True, array_like=True):
    """Blocks appended to one plane's block table of one request.

    The block table maps logical page i (token positions [i*B, (i+1)*B)) to a physical block.
    `first_page` is the logical page index of `block_ids[0]`; pages before it are unchanged.
    """

    plane: int
    first_page: int
    block_ids: tuple[int, ...]


class PageScores(msgspec.Struct, frozen=True):
    """The prompt scores of one full prompt page's positions, kept with the page in the prefix
    cache so a scored prompt (`SamplingParams.prompt_logprobs`) that reuses the page takes them
    instead of recomputing the positions (0.1.12).

    Page i holds positions [i*B, (i+1)*B); position p scores prompt token p + 1, so entry j is
    token i*B + j + 1's score: its log-probability, its rank (1 = the most likely) and the
    `top_n` most likely (token id, log-probability) pairs, all under the state of position
    i*B + j (as `PromptLogprobs`). With exit-depth scoring `exit_depths[j]` is that position's
    exit depth; empty at full depth. The last entry scores the token after the page, so a
    record belongs to (page key, that next token), not to the page alone.

    A record with `top_n` alternatives serves a request asking for n <= top_n (the first n).
    """

    top_n: int
    token_logprobs: tuple[float, ...]
    token_ranks: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    exit_depths: tuple[int, ...] = ()


class PrefixMatch(msgspec.Struct, frozen=True):
    """Leading full prompt pages whose KV the prefix cache can give a request (a pure lookup
    result of `KVPort.match_prefix`; `NO_PREFIX` when nothing is reused).

    keys: the matched pages' chained content keys (opaque outside rlt-kv; `allocate` touches
      them in the cache's LRU order).
    blocks: per matched page, its physical block at every plane (`allocate` references them).
    num_tokens: reusable prompt positions, a multiple of the block size.
    cached_claim_blocks: of those blocks, how many only the cache holds now (evictable, counted
      as free), which admitting the request would pin.
    scores: for a scored lookup (`match_prefix(..., score_top_n=n)`), each matched page's
      `PageScores` (with at least n alternatives); empty otherwise (0.1.12).

    The scheduler reads the counts and the scores and hands the match back to `allocate`
    unchanged.
    """

    keys: tuple[bytes, ...] = ()
    blocks: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0
    cached_claim_blocks: int = 0
    scores: tuple[PageScores, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks of the matched pages over all planes."""
        return sum(len(page) for page in self.blocks)


NO_PREFIX = PrefixMatch()  # reuses nothing: a cache miss, no prefix cache, or a resumed request


class KVPort(Protocol):
    """The logical-KV operations the scheduler uses (implemented by rlt-kv's `KVCacheManager`).

    The scheduler never reads reference counts or allocations (R11): it asks for costs,
    allocations, growth, release and prefix publication here. Counts are in blocks (one block =
    `block_size` positions of one plane) or in token positions, as named.
    """

    num_blocks: int  # blocks in the pool
    block_size: int  # token positions per block (and per prefix-cache page)

    def capacity(self) -> KVCapacity: ...

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one request needs to hold positions [0, num_tokens) at every plane."""
        ...

    def held_blocks(self, identity: ExecutionIdentity) -> int: ...

    def allocated_tokens(self, identity: ExecutionIdentity) -> int:
        """Positions [0, n) the request's blocks can hold (0 if it holds none)."""
        ...

    def page_keys(self, prompt_token_ids: Sequence[int], *, salt: bytes = b"") -> tuple[bytes, ...]:
        """Chained content keys of the prompt's publishable full pages (those inside
        `prompt_token_ids[:-1]`) under `salt` (pure; () without a prefix cache): the keys its
        pages are published and looked up by, so two prompts share their first k pages iff
        their first k keys are equal. Opaque outside rlt-kv except for equality (0.1.12)."""
        ...

    def match_prefix(
        self,
        prompt_token_ids: Sequence[int],
        *,
        salt: bytes = b"",
        score_top_n: int | None = None,
    ) -> PrefixMatch:
        """Reusable leading pages of the prompt (pure: changes nothing). `salt`: pages
        published under the same salt only (b"": prefill's KV; see `publish_prefix`).
        `score_top_n`: a scored prompt's lookup: only leading pages that also hold a
        `PageScores` record for this prompt's next token with at least that many alternatives
        (the match carries the records)."""
        ...

    def allocate(
        self,
        identity: ExecutionIdentity,
        num_tokens: int,
        prefix: PrefixMatch = NO_PREFIX,
        *,
        prompt_length: int = 0,
    ) -> tuple[BlockTableUpdate, ...] | None:
        """Claim blocks for positions [0, num_tokens), reusing `prefix`'s pages; None (and no
        change) when the pool cannot supply them."""
        ...

    def grow(
        self, identity: ExecutionIdentity, num_tokens: int
    ) -> tuple[BlockTableUpdate, ...] | None:
        """Extend to positions [0, num_tokens): the appended blocks, () if none were needed,
        None (and no change) when the pool cannot supply them."""
        ...

    def free(self, identity: ExecutionIdentity) -> None:
        """Return the request's blocks (idempotent)."""
        ...

    def publish_prefix(
        self,
        identity: ExecutionIdentity,
        prompt_token_ids: Sequence[int],
        computed_tokens: int,
        *,
        salt: bytes = b"",
        page_scores: Callable[[int, int], PageScores] | None = None,
    ) -> int:
        """Publish prompt pages reported computed at every depth (completion evidence, R18);
        returns the pages newly published. `salt` names KV that differs from prefill's (a
        prompt run at exit depth: the exit rule's parameters), so only lookups with the same
        salt find it. `page_scores(start, end)`: the scores of positions [start, end) of a page
        this call publishes (or finds already cached), kept with the page (0.1.12)."""
        ...
