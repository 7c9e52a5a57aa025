"""`KVCacheManager` implements the contracts' `KVPort` completely, and a prefix miss is the one
`NO_PREFIX` value whatever produced it (R05, R11)."""

from __future__ import annotations

import inspect

from rlt_contracts import NO_PREFIX, ExecutionIdentity, KVPort, PrefixMatch
from rlt_kv import KVCacheManager


def port_members() -> list[str]:
    """Every attribute and method the protocol declares (what the scheduler may use)."""
    declared = set(KVPort.__annotations__)
    declared |= {
        name
        for name, value in vars(KVPort).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    return sorted(declared)


def test_manager_has_every_port_member_with_the_declared_parameters():
    manager = KVCacheManager(num_blocks=8, block_size=2, num_planes=2)
    assert port_members() == sorted(
        [
            "num_blocks",
            "block_size",
            "capacity",
            "blocks_for",
            "held_blocks",
            "allocated_tokens",
            "page_keys",
            "match_prefix",
            "allocate",
            "grow",
            "free",
            "publish_prefix",
        ]
    )
    for name in port_members():
        assert hasattr(manager, name), name
        declared = getattr(KVPort, name, None)
        if inspect.isfunction(declared):
            expected = list(inspect.signature(declared).parameters)[1:]
            assert list(inspect.signature(getattr(manager, name)).parameters) == expected, name


def test_a_miss_is_the_single_no_prefix_value_and_allocates_fresh_blocks():
    identity = ExecutionIdentity("a", 0)
    for caching in (False, True):
        manager = KVCacheManager(
            num_blocks=16, block_size=2, num_planes=2, enable_prefix_caching=caching
        )
        miss = manager.match_prefix([1, 2, 3, 4, 5])
        assert miss is NO_PREFIX or miss == NO_PREFIX
        assert (miss.num_tokens, miss.num_blocks, miss.cached_claim_blocks) == (0, 0, 0)
        updates = manager.allocate(identity, 5, NO_PREFIX, prompt_length=5)
        assert [len(u.block_ids) for u in updates] == [3, 3]
        manager.free(identity)


def test_a_hit_is_a_prefix_match_the_allocation_reuses():
    manager = KVCacheManager(num_blocks=16, block_size=2, num_planes=2, enable_prefix_caching=True)
    first, second = ExecutionIdentity("a", 0), ExecutionIdentity("b", 1)
    prompt = [1, 2, 3, 4, 5]
    manager.allocate(first, 5, manager.match_prefix(prompt), prompt_length=5)
    manager.publish_prefix(first, prompt, 5)
    hit = manager.match_prefix(prompt)
    assert isinstance(hit, PrefixMatch)
    assert (hit.num_tokens, hit.num_blocks, len(hit.keys)) == (4, 4, 2)
    reused = manager.block_tables(first)
    updates = manager.allocate(second, 5, hit, prompt_length=5)
    for plane, update in enumerate(updates):
        assert update.block_ids[:2] == reused[plane][:2]
    assert manager.prefix_hit_tokens == 4
    manager.free(first)
    manager.free(second)
