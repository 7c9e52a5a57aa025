"""Logical KV-cache contracts: layouts, capacity views and admission plans (owned by rlt-kv)."""

from __future__ import annotations

import enum

import msgspec


class KVLayout(enum.StrEnum):
    """How KV entries are kept across loop depths.

    LAST_EXITED  one storage plane per loop depth. A token that exits at depth e gets its depth-e
                 KV copied into the deeper planes e+1..T-1, so a later query at loop d reads the
                 version min(d, e). With threshold 1.0 this equals the per-depth KV of the
                 Hugging Face reference.
    SHARED       one plane, overwritten by every loop; later tokens read each earlier token's final
                 version at every depth. Uses 1/T of the memory but changes model semantics.
    """

    LAST_EXITED = "last_exited"
    SHARED = "shared"

    def storage_planes(self, model_depth: int) -> int:
        """Number of physical KV planes one token position occupies."""
        return model_depth if self is KVLayout.LAST_EXITED else 1

    def plane_of_loop(self, loop_index: int) -> int:
        """Plane (0-based) that loop `loop_index` (1-based) reads and writes."""
        return loop_index - 1 if self is KVLayout.LAST_EXITED else 0


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
