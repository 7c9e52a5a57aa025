"""`KVPort`: the logical-KV operations the scheduler uses (implemented by rlt-kv's manager).

The scheduler never reads reference counts or allocation internals (R11); it asks for costs,
allocations, growth and release through these calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rlt_contracts import BlockTableUpdate, ExecutionIdentity, KVCapacity


class PrefixLookup(Protocol):
    """Reusable leading prompt pages: `num_tokens` positions (`num_blocks` blocks over all
    planes), of which `cached_claim_blocks` are evictable now and would be pinned."""

    num_tokens: int
    num_blocks: int
    cached_claim_blocks: int


class KVPort(Protocol):
    num_blocks: int
    num_planes: int
    block_size: int

    def capacity(self) -> KVCapacity: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    def held_blocks(self, identity: ExecutionIdentity) -> int: ...

    def allocated_tokens(self, identity: ExecutionIdentity) -> int: ...

    def match_prefix(self, prompt_token_ids: Sequence[int]) -> PrefixLookup: ...

    def allocate(
        self,
        identity: ExecutionIdentity,
        num_tokens: int,
        prefix: PrefixLookup,
        *,
        prompt_length: int = 0,
    ) -> tuple[BlockTableUpdate, ...] | None: ...

    def grow(
        self, identity: ExecutionIdentity, num_tokens: int
    ) -> tuple[BlockTableUpdate, ...] | None: ...

    def free(self, identity: ExecutionIdentity) -> None: ...

    def publish_prefix(
        self, identity: ExecutionIdentity, prompt_token_ids: Sequence[int], computed_tokens: int
    ) -> int: ...
