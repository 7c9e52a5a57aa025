"""Logical KV: per-plane tables, growth, release, prefix sharing, LRU eviction and refusals."""

from __future__ import annotations

import pytest
from rlt_contracts import ExecutionIdentity
from rlt_kv import KVCacheManager, cacheable_pages, page_keys


def ident(name: str, generation: int = 0) -> ExecutionIdentity:
    return ExecutionIdentity(name, generation)


def test_allocation_covers_every_plane_and_frees_completely():
    kv = KVCacheManager(num_blocks=40, block_size=4, num_planes=4)
    updates = kv.allocate(ident("a"), 10)  # ceil(10/4) = 3 pages x 4 planes
    assert [len(u.block_ids) for u in updates] == [3, 3, 3, 3]
    assert kv.capacity().free_blocks == 28 and kv.held_blocks(ident("a")) == 12
    assert kv.allocated_tokens(ident("a")) == 12
    all_blocks = [b for u in updates for b in u.block_ids]
    assert len(set(all_blocks)) == 12
    kv.free(ident("a"))
    kv.free(ident("a"))  # idempotent
    assert kv.capacity().free_blocks == 40


def test_refused_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_planes=2)
    assert kv.allocate(ident("a"), 16) is not None  # 8 blocks
    assert kv.allocate(ident("b"), 8) is None  # needs 4, 2 free
    assert not kv.has_allocation(ident("b")) and kv.capacity().free_blocks == 2


def test_growth_appends_pages_per_plane():
    kv = KVCacheManager(num_blocks=20, block_size=2, num_planes=2)
    kv.allocate(ident("a"), 3)
    assert kv.grow(ident("a"), 4) == ()
    updates = kv.grow(ident("a"), 7)
    assert [(u.plane, u.first_page, len(u.block_ids)) for u in updates] == [(0, 2, 2), (1, 2, 2)]
    tables = kv.block_tables(ident("a"))
    assert [len(t) for t in tables] == [4, 4]
    assert kv.grow(ident("a"), 100) is None and [len(t) for t in kv.block_tables(ident("a"))] == [
        4,
        4,
    ]


def test_prefix_pages_are_shared_and_final_token_excluded():
    kv = KVCacheManager(num_blocks=64, block_size=2, num_planes=4, enable_prefix_caching=True)
    prompt = (5, 6, 7, 8, 9)  # pages [5,6] [7,8]; token 9 is the final prompt token
    assert cacheable_pages(len(prompt), len(prompt), 2) == 2
    kv.allocate(ident("a"), len(prompt) + 3, prompt_length=5)
    assert kv.publish_prefix(ident("a"), prompt, 5) == 2
    match = kv.match_prefix(prompt)
    assert match.num_tokens == 4 and len(match.blocks) == 2
    assert match.cached_claim_blocks == 0  # still held by "a"
    kv.allocate(ident("b"), len(prompt) + 3, match, prompt_length=5)
    a, b = kv.block_tables(ident("a")), kv.block_tables(ident("b"))
    for plane in range(4):
        assert a[plane][:2] == b[plane][:2] and a[plane][2:] != b[plane][2:]
    assert kv.prefix_hit_tokens == 4 and kv.prefix_queried_tokens == 10
    # a prompt that differs in page 2 reuses exactly one page
    assert kv.match_prefix((5, 6, 7, 99, 9)).num_tokens == 2


def test_eviction_is_lru_and_never_drops_pages_in_use():
    kv = KVCacheManager(num_blocks=12, block_size=2, num_planes=2, enable_prefix_caching=True)
    p1, p2 = (1, 2, 3), (4, 5, 6)
    for name, prompt in (("a", p1), ("b", p2)):
        kv.allocate(ident(name), 3, prompt_length=3)  # 2 pages x 2 planes
        kv.publish_prefix(ident(name), prompt, 3)
        kv.free(ident(name))
    assert kv.capacity().free_blocks == 12 and kv.capacity().cached_blocks == 4
    user = ident("c")
    kv.allocate(user, 3, kv.match_prefix(p2), prompt_length=3)  # pins p2's page, touches it
    assert kv.capacity().cached_blocks == 2  # only p1's page is evictable now
    big = ident("d")
    assert kv.allocate(big, 12) is None  # would need p2's pinned page: refused, cache intact
    assert len(kv.match_prefix(p1).blocks) == 1 and len(kv.match_prefix(p2).blocks) == 1
    assert kv.allocate(big, 8) is not None  # 8 blocks: evicts p1 (LRU), keeps p2 in use
    assert kv.match_prefix(p1).num_tokens == 0 and kv.match_prefix(p2).num_tokens == 2
    kv.free(big)
    kv.free(user)
    kv.clear_prefix_cache()
    assert kv.capacity().free_blocks == 12 and kv.capacity().cached_blocks == 0


def test_page_keys_chain_depends_on_all_earlier_tokens():
    k1 = page_keys((1, 2, 3, 4), 2, 2)
    k2 = page_keys((9, 2, 3, 4), 2, 2)
    assert k1[1] != k2[1] and len(k1[0]) == 32


def test_double_allocation_is_a_bug():
    kv = KVCacheManager(num_blocks=8, block_size=2, num_planes=1)
    kv.allocate(ident("a"), 2)
    with pytest.raises(RuntimeError):
        kv.allocate(ident("a"), 2)


def test_each_planes_fresh_pages_are_one_run_of_consecutive_blocks():
    """A PD handoff merges pages contiguous on both instances into one descriptor per
    (tensor, layer): fresh pages dealt to the planes block by block would make every page a
    descriptor of its own. Allocation and growth give each plane consecutive ids wherever the
    free list has them, also after other requests freed theirs in a different order."""
    kv = KVCacheManager(num_blocks=68, block_size=4, num_planes=4)
    for name in ("a", "b", "c"):
        kv.allocate(ident(name), 20)  # 5 pages per plane
    kv.free(ident("b"))
    kv.free(ident("a"))
    kv.grow(ident("c"), 28)  # 2 more pages per plane: the last 8 never-used blocks
    kv.allocate(ident("d"), 40)  # 10 pages per plane: exactly what b and a freed
    for name in ("c", "d"):
        for table in kv.block_tables(ident(name)):
            runs = sum(1 for x, y in zip(table, table[1:], strict=False) if y != x + 1) + 1
            assert runs <= 2, (name, table)  # c: allocation + growth; d: its run from the pool
    fresh = KVCacheManager(num_blocks=40, block_size=4, num_planes=4)
    tables = [list(t) for t in (u.block_ids for u in fresh.allocate(ident("a"), 16))]
    assert tables == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def page_scores(top_n: int, *, depths: bool = False):
    """A `page_scores(start, end)` callback whose scores name their positions."""
    from rlt_contracts import PageScores

    def scores(start: int, end: int) -> PageScores:
        positions = range(start, end)
        return PageScores(
            top_n=top_n,
            token_logprobs=tuple(-0.125 * (p + 1) for p in positions),
            token_ranks=tuple(p + 1 for p in positions),
            top_logprobs=tuple(
                tuple((p * 10 + k, -0.5 * k) for k in range(top_n)) for p in positions
            ),
            exit_depths=tuple(1 + p % 4 for p in positions) if depths else (),
        )

    return scores


def test_a_scored_lookup_takes_only_pages_with_score_records_for_its_next_token():
    """Records belong to (page, next token): the last position of a page scores the token after
    it. A scored lookup stops at the first page without a fitting record; a plain one ignores
    records; a request asking for more alternatives than a record has recomputes that page and
    its record replaces the smaller one."""
    kv = KVCacheManager(num_blocks=64, block_size=2, num_planes=2, enable_prefix_caching=True)
    plain, scored = (1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 5, 9, 7)
    kv.allocate(ident("plain"), 7, prompt_length=7)
    kv.publish_prefix(ident("plain"), plain, 7)  # pages [1,2] [3,4] [5,6], no scores
    assert kv.match_prefix(plain, score_top_n=0).num_tokens == 0
    kv.allocate(ident("s"), 7, prompt_length=7)
    kv.publish_prefix(ident("s"), scored, 4, page_scores=page_scores(2))  # pages 0 and 1 only
    hit = kv.match_prefix(scored, score_top_n=1)
    assert hit.num_tokens == 4 and len(hit.scores) == 2
    assert hit.scores[1].token_logprobs == (-0.375, -0.5)  # positions 2 and 3
    assert hit.scores[1].top_logprobs[0] == ((20, -0.0), (21, -0.5))
    assert kv.match_prefix(scored, score_top_n=3).num_tokens == 0  # records hold 2
    # page 1's record scores token 5 (its next token): a prompt going on with 8 misses it
    assert kv.match_prefix((1, 2, 3, 4, 8, 6, 7), score_top_n=1).num_tokens == 2
    assert kv.match_prefix(scored).num_tokens == 4 and kv.match_prefix(scored).scores == ()
    kv.publish_prefix(ident("s"), scored, 7, page_scores=page_scores(3))
    assert kv.match_prefix(scored, score_top_n=1).num_tokens == 6  # page 2 recorded now
    assert kv.match_prefix(scored, score_top_n=3).num_tokens == 0  # page 0 still holds 2
    kv.allocate(ident("wide"), 7, prompt_length=7)
    kv.publish_prefix(ident("wide"), scored, 7, page_scores=page_scores(3))
    assert kv.match_prefix(scored, score_top_n=3).num_tokens == 6  # replaced by wider ones
    for name in ("plain", "s", "wide"):
        kv.free(ident(name))
    kv.clear_prefix_cache()
    assert kv.capacity().free_blocks == 64 and kv.match_prefix(scored, score_top_n=0).scores == ()


def test_salted_pages_are_found_only_under_their_salt():
    kv = KVCacheManager(num_blocks=64, block_size=2, num_planes=2, enable_prefix_caching=True)
    prompt = (1, 2, 3, 4, 5)
    kv.allocate(ident("exit"), 5, prompt_length=5)
    kv.publish_prefix(
        ident("exit"), prompt, 5, salt=b"rule-a", page_scores=page_scores(1, depths=True)
    )
    assert kv.match_prefix(prompt).num_tokens == 0
    assert kv.match_prefix(prompt, salt=b"rule-b", score_top_n=1).num_tokens == 0
    hit = kv.match_prefix(prompt, salt=b"rule-a", score_top_n=1)
    assert hit.num_tokens == 4 and hit.scores[0].exit_depths == (1, 2)
    kv.free(ident("exit"))


def test_page_keys_name_the_pages_publication_and_lookup_use():
    """`page_keys`: the publishable pages' keys under a salt, so prompts that share k pages
    share k keys (the scheduler compares them to wait for pages being computed)."""
    kv = KVCacheManager(num_blocks=64, block_size=2, num_planes=2, enable_prefix_caching=True)
    prompt = (1, 2, 3, 4, 5, 6)  # publishable: pages [1,2] [3,4] (6 is the final token's page)
    keys = kv.page_keys(prompt)
    assert len(keys) == 2 and kv.page_keys(prompt[:5] + (9,)) == keys
    other = kv.page_keys((1, 2, 7, 4, 5, 6))
    assert other[0] == keys[0] and other[1] != keys[1]
    assert kv.page_keys((9, 2, 3, 4, 5, 6))[1] != keys[1]  # chained: page 0 differs
    salted = kv.page_keys(prompt, salt=b"rule")
    assert len(salted) == 2 and not set(salted) & set(keys)
    kv.allocate(ident("a"), 6, prompt_length=6)
    kv.publish_prefix(ident("a"), prompt, 6, salt=b"rule")
    assert kv.match_prefix(prompt, salt=b"rule").keys == salted
    kv.free(ident("a"))
    plain = KVCacheManager(num_blocks=64, block_size=2, num_planes=2)
    assert plain.page_keys(prompt) == ()


def test_score_records_go_with_their_page_and_within_their_byte_bound():
    # 2 positions x (8 + 4 + 1 x (4 + 8)) bytes = 48 bytes per top-1 record
    kv = KVCacheManager(
        num_blocks=8, block_size=2, num_planes=1, enable_prefix_caching=True, score_record_bytes=100
    )
    p1, p2, p3 = (1, 2, 3), (4, 5, 6), (7, 8, 9)
    for name, prompt in (("a", p1), ("b", p2), ("c", p3)):
        kv.allocate(ident(name), 3, prompt_length=3)
        kv.publish_prefix(ident(name), prompt, 3, page_scores=page_scores(1))
        kv.free(ident(name))
    # the bound keeps two records: p1's, the oldest, went; its KV stays
    assert kv.match_prefix(p1, score_top_n=1).num_tokens == 0
    assert kv.match_prefix(p1).num_tokens == 2
    assert kv.match_prefix(p3, score_top_n=1).num_tokens == 2
    kv.allocate(ident("d"), 3, kv.match_prefix(p3, score_top_n=1), prompt_length=3)  # touches p3
    kv.free(ident("d"))
    kv.allocate(ident("big"), 14)  # evicts every cached page: p1's, p2's and p3's
    assert kv.match_prefix(p2, score_top_n=1).num_tokens == 0
    kv.free(ident("big"))
    kv.allocate(ident("e"), 3, prompt_length=3)
    kv.publish_prefix(ident("e"), p2, 3)  # p2 cached again, without scores
    assert kv.match_prefix(p2, score_top_n=1).num_tokens == 0
    kv.free(ident("e"))
