"""Handoff plan: coalescing, partial pages, partition limits, splitting and the hidden state."""

from __future__ import annotations

import random

import pytest
from pd_harness import IDENT, K, V, descriptors, random_tables, region, simulate
from rlt_pd import plan_handoff


def test_contiguous_tables_coalesce_per_tensor_and_layer():
    r = region(layers=2)  # block of one layer = 4 tokens x 8 bytes = 32 bytes
    plan = plan_handoff(IDENT, [[0, 1, 2]], [[10, 11, 12]], 12, r, hidden_state_bytes=8)
    assert [(d.tensor, d.layer, d.length_bytes) for d in descriptors(plan)] == [
        (K, 0, 96),
        (K, 1, 96),
        (V, 0, 96),
        (V, 1, 96),
    ]
    # a partial last page continues a contiguous run
    plan = plan_handoff(IDENT, [[0, 1, 2]], [[10, 11, 12]], 10, r, hidden_state_bytes=8)
    assert [d.length_bytes for d in descriptors(plan)] == [80] * 4
    # runs continue across planes when both sides stay contiguous ...
    plan = plan_handoff(IDENT, [[0, 1], [2, 3]], [[4, 5], [6, 7]], 8, r, hidden_state_bytes=8)
    assert [d.length_bytes for d in descriptors(plan)] == [128] * 4
    # ... but never across a partial page
    plan = plan_handoff(IDENT, [[0, 1], [2, 3]], [[4, 5], [6, 7]], 6, r, hidden_state_bytes=8)
    assert [d.length_bytes for d in descriptors(plan)] == [48, 48] * 4
    # ... nor across layers, even when the bytes happen to be adjacent (layer stride = 64)
    plan = plan_handoff(IDENT, [[0], [1]], [[0], [1]], 4, region(2, layers=2), hidden_state_bytes=8)
    assert [
        (d.tensor, d.layer, d.source_offset_bytes, d.length_bytes) for d in descriptors(plan)
    ] == [(K, 0, 0, 64), (K, 1, 64, 64), (V, 0, 0, 64), (V, 1, 64, 64)]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([0, 1, 2], [10, 12, 11]),  # source contiguous, destination not
        ([0, 2, 1], [10, 11, 12]),  # destination contiguous, source not
        ([2, 1, 0], [12, 11, 10]),  # both descending
    ],
)
def test_no_coalescing_unless_contiguous_on_both_sides(src, dst):
    plan = plan_handoff(IDENT, [src], [dst], 12, region(layers=2), hidden_state_bytes=8)
    assert [d.length_bytes for d in descriptors(plan)] == [32] * 12


@pytest.mark.parametrize(("valid", "lengths"), [(8, [32, 32]), (6, [32, 16]), (5, [32, 8])])
def test_page_boundary_vs_mid_page(valid, lengths):
    r = region(layers=1)
    plan = plan_handoff(IDENT, [[3, 7]], [[5, 1]], valid, r, hidden_state_bytes=8)
    got = descriptors(plan)
    assert [d.length_bytes for d in got] == lengths * 2  # key, then value
    assert [(d.source_offset_bytes, d.destination_offset_bytes) for d in got[:2]] == [
        (3 * 32, 5 * 32),
        (7 * 32, 1 * 32),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_partitions_respect_both_limits_and_keep_order(seed):
    rng = random.Random(seed)
    r, planes, valid = region(64), rng.choice([1, 4]), rng.randrange(1, 30)
    chunk, max_desc = rng.randrange(32, 400), rng.randrange(1, 6)
    pages = -(-valid // 4)
    src, dst = random_tables(rng, planes, pages, 64), random_tables(rng, planes, pages, 64)
    plan = plan_handoff(
        IDENT,
        src,
        dst,
        valid,
        r,
        hidden_state_bytes=16,
        transfer_chunk_bytes=chunk,
        max_descriptors=max_desc,
    )
    unbounded = plan_handoff(IDENT, src, dst, valid, r, hidden_state_bytes=16)
    assert [p.sequence for p in plan.partitions] == list(range(plan.commit_count))
    for p in plan.partitions:
        assert p.total_bytes <= chunk and p.num_writes <= max_desc
        assert p.kv_bytes == sum(d.length_bytes for d in p.descriptors)
        assert p.num_writes >= 1
    assert [p.hidden_state_bytes for p in plan.partitions[:-1]] == [0] * (plan.commit_count - 1)
    assert plan.partitions[-1].hidden_state_bytes == 16

    # same bytes in the same order; only splitting differs
    def flat(pl):
        return [
            (d.tensor, d.layer, d.source_offset_bytes + i, d.destination_offset_bytes + i)
            for d in descriptors(pl)
            for i in range(d.length_bytes)
        ]

    assert flat(plan) == flat(unbounded)
    simulate(plan, r, r, src, dst, rng)


def test_range_larger_than_chunk_is_split():
    r = region(layers=1)  # one plane, 16 contiguous tokens = one 128-byte range per tensor
    plan = plan_handoff(
        IDENT,
        [[0, 1, 2, 3]],
        [[8, 9, 10, 11]],
        16,
        r,
        hidden_state_bytes=16,
        transfer_chunk_bytes=48,
    )
    layout = [
        [
            (d.tensor, d.source_offset_bytes, d.destination_offset_bytes, d.length_bytes)
            for d in p.descriptors
        ]
        for p in plan.partitions
    ]
    assert layout == [
        [(K, 0, 256, 48)],
        [(K, 48, 304, 48)],
        [(K, 96, 352, 32)],
        [(V, 0, 256, 48)],
        [(V, 48, 304, 48)],
        [(V, 96, 352, 32)],
    ]
    assert plan.partitions[-1].hidden_state_bytes == 16 and plan.commit_count == 6


def test_hidden_state_gets_its_own_partition_when_the_last_is_full():
    r = region(layers=1)
    by_bytes = plan_handoff(
        IDENT, [[0]], [[1]], 4, r, hidden_state_bytes=16, transfer_chunk_bytes=64
    )  # K 32 + V 32 fill the chunk
    assert [
        (len(p.descriptors), p.kv_bytes, p.hidden_state_bytes) for p in by_bytes.partitions
    ] == [(2, 64, 0), (0, 0, 16)]
    by_count = plan_handoff(IDENT, [[0]], [[1]], 4, r, hidden_state_bytes=16, max_descriptors=2)
    assert [p.num_writes for p in by_count.partitions] == [2, 1]
    fits = plan_handoff(IDENT, [[0]], [[1]], 4, r, hidden_state_bytes=16, max_descriptors=3)
    assert [p.num_writes for p in fits.partitions] == [3]


def test_chunk_plans_continue_sequences_and_only_the_final_one_has_the_hidden_state():
    r = region(layers=1)
    src, dst = [[0, 1, 2]], [[5, 6, 7]]
    kwargs = dict(hidden_state_bytes=16, transfer_chunk_bytes=48)
    first = plan_handoff(IDENT, src, dst, 6, r, final=False, **kwargs)  # page 0 + 2 tokens
    assert [p.sequence for p in first.partitions] == [0, 1]
    assert all(p.hidden_state_bytes == 0 for p in first.partitions)
    assert first.total_bytes == first.kv_bytes == 2 * 6 * 8
    last = plan_handoff(
        IDENT, src, dst, 10, r, first_token=6, first_sequence=first.commit_count, **kwargs
    )
    assert [p.sequence for p in last.partitions] == [2, 3]
    assert last.partitions[-1].hidden_state_bytes == 16 and last.commit_count == 4
    # a token-exact split of page 1: chunk 0 wrote its tokens 0-1, the final chunk starts at
    # token 2 (and runs on into page 2, contiguous on both sides: one range per tensor)
    ranges = [
        (d.destination_offset_bytes, d.length_bytes) for p in last.partitions for d in p.descriptors
    ]
    assert ranges == [(6 * 32 + 2 * 8, 4 * 8)] * 2
    nothing = plan_handoff(IDENT, src, dst, 4, r, first_token=4, final=False, **kwargs)
    assert nothing.partitions == () and nothing.commit_count == 0
    with pytest.raises(ValueError, match="first_sequence"):
        plan_handoff(IDENT, src, dst, 4, r, first_sequence=-1, **kwargs)
