"""Handoff plan: exact byte accounting, a byte-level copy simulation, the README example,
serialization and input validation."""

from __future__ import annotations

import random

import msgspec
import pytest
from pd_harness import (
    IDENT,
    K,
    V,
    block_major,
    descriptors,
    expected_kv_bytes,
    random_tables,
    region,
    simulate,
)
from rlt_contracts import ExecutionIdentity, KVLayout
from rlt_pd import HandoffPlan, KVRegion, plan_handoff


@pytest.mark.parametrize("layout", [KVLayout.SHARED, KVLayout.LAST_EXITED])
@pytest.mark.parametrize("valid", [0, 1, 4, 6, 8, 13])
def test_byte_accounting_is_exact(layout, valid):
    r, planes = region(), layout.storage_planes(4)
    pages = -(-valid // 4)
    rng = random.Random(valid)
    plan = plan_handoff(
        IDENT,
        random_tables(rng, planes, pages, 32),
        random_tables(rng, planes, pages, 32),
        valid,
        r,
        hidden_state_bytes=24,
        transfer_chunk_bytes=100,
        max_descriptors=5,
    )
    assert plan.kv_bytes == expected_kv_bytes(valid, planes, r)
    assert plan.total_bytes == plan.kv_bytes + 24 == sum(p.total_bytes for p in plan.partitions)
    assert sum(d.length_bytes for p in plan.partitions for d in p.descriptors) == plan.kv_bytes
    assert plan.num_planes == planes and plan.identity == IDENT


LAYOUTS = {
    "contiguous": (region(), region()),
    "scratch_block": (region(allocated=33), region(allocated=33)),
    "block_major": (block_major(), block_major()),
    "different_pools": (region(20, allocated=21), region(40)),
    "mixed_layouts": (region(), block_major(40)),
}


@pytest.mark.parametrize("regions", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("planes", [1, 4])
@pytest.mark.parametrize(
    ("first", "valid"), [(0, 0), (0, 8), (0, 6), (0, 13), (4, 13), (5, 13), (5, 5)]
)
@pytest.mark.parametrize("chunk", [40, 1 << 20])
def test_copy_simulation_lands_every_valid_byte_and_nothing_else(
    regions, planes, first, valid, chunk
):
    src_region, dst_region = regions
    rng = random.Random(hash((planes, first, valid, chunk)))
    pages = -(-valid // 4)
    src_tables = random_tables(rng, planes, pages, src_region.num_blocks)
    dst_tables = random_tables(rng, planes, pages, dst_region.num_blocks)
    plan = plan_handoff(
        IDENT,
        src_tables,
        dst_tables,
        valid,
        src_region,
        destination_region=dst_region,
        first_token=first,
        hidden_state_bytes=8,
        transfer_chunk_bytes=chunk,
        max_descriptors=7,
    )
    assert plan.kv_bytes == expected_kv_bytes(valid, planes, src_region, first)
    simulate(plan, src_region, dst_region, src_tables, dst_tables, rng)


def test_simulation_with_sequential_tables_coalesced_and_split():
    r = region(64)
    tables = [[p * 4 + i for i in range(4)] for p in range(4)]  # fully contiguous on both sides
    dst = [[b + 10 for b in t] for t in tables]
    plan = plan_handoff(IDENT, tables, dst, 15, r, hidden_state_bytes=8, transfer_chunk_bytes=48)
    simulate(plan, r, r, tables, dst, random.Random(0))


@pytest.mark.parametrize("planes", [1, 4])
def test_zero_valid_tokens_sends_only_the_hidden_state(planes):
    plan = plan_handoff(IDENT, [[]] * planes, [[]] * planes, 0, region(), hidden_state_bytes=64)
    assert plan.commit_count == 1 and plan.kv_bytes == 0
    only = plan.partitions[0]
    assert only.sequence == 0 and only.descriptors == () and only.hidden_state_bytes == 64
    cached = plan_handoff(
        IDENT, [[0, 1]], [[2, 3]], 8, region(), first_token=8, hidden_state_bytes=64
    )
    assert cached.partitions == plan.partitions
    mid_page = plan_handoff(  # nothing left to send needs no pages, even mid-page
        IDENT, [[]], [[]], 5, region(), first_token=5, hidden_state_bytes=64
    )
    assert mid_page.partitions == plan.partitions


def test_readme_worked_example():
    r = KVRegion.contiguous(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype_bytes=2
    )
    plan = plan_handoff(
        ExecutionIdentity("r1", 0),
        [[0, 1], [2, 3]],
        [[4, 5], [1, 6]],
        6,
        r,
        hidden_state_bytes=16,
        transfer_chunk_bytes=64,
        max_descriptors=4,
    )
    per_layer = [(0, 64, 24), (32, 16, 16), (48, 96, 8)]
    assert [
        [
            (d.tensor, d.layer, d.source_offset_bytes, d.destination_offset_bytes, d.length_bytes)
            for d in p.descriptors
        ]
        for p in plan.partitions
    ] == [
        [(t, layer, s + 128 * layer, o + 128 * layer, n) for s, o, n in per_layer]
        for t in (K, V)
        for layer in (0, 1)
    ]
    assert [(p.kv_bytes, p.hidden_state_bytes) for p in plan.partitions] == [
        (48, 0),
        (48, 0),
        (48, 0),
        (48, 16),
    ]
    assert (plan.commit_count, plan.kv_bytes, plan.total_bytes) == (4, 192, 208)


def test_plan_round_trips_through_msgspec():
    plan = plan_handoff(
        IDENT,
        [[0, 1], [2, 3]],
        [[4, 5], [1, 6]],
        6,
        region(),
        hidden_state_bytes=8,
        transfer_chunk_bytes=64,
        max_descriptors=4,
    )
    for codec in (msgspec.json, msgspec.msgpack):
        assert codec.decode(codec.encode(plan), type=HandoffPlan) == plan
    assert b'"key"' in msgspec.json.encode(plan)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"source_tables": [[0, 1]], "destination_tables": [[2, 3], [4, 5]]},
            "plane count differs",
        ),
        ({"source_tables": [], "destination_tables": []}, "at least one plane"),
        ({"source_tables": [[0]], "destination_tables": [[2, 3]]}, "source table of plane 0 has 1"),
        ({"source_tables": [[0, 1]], "destination_tables": [[2, 32]]}, "destination block id 32"),
        ({"source_tables": [[-1, 1]], "destination_tables": [[2, 3]]}, "source block id -1"),
        (
            {"source_tables": [[0, 1]], "destination_tables": [[2, 2]]},
            "destination block 2 is used",
        ),
        ({"valid_tokens": -1}, "valid_tokens must be >= 0"),
        ({"first_token": 7}, "first_token 7"),
        ({"hidden_state_bytes": 0}, "hidden_state_bytes 0"),
        ({"hidden_state_bytes": 65, "transfer_chunk_bytes": 64}, "hidden_state_bytes 65"),
        ({"max_descriptors": 0}, "max_descriptors"),
        ({"destination_region": region(head_dim=4)}, "geometry differ"),
    ],
)
def test_invalid_inputs_raise_clear_errors(kwargs, message):
    args = {
        "source_tables": [[0, 1]],
        "destination_tables": [[2, 3]],
        "valid_tokens": 6,
        "hidden_state_bytes": 8,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        plan_handoff(
            IDENT,
            args.pop("source_tables"),
            args.pop("destination_tables"),
            args.pop("valid_tokens"),
            region(),
            **args,
        )


def test_region_validation_and_unknown_pool_size():
    r = KVRegion(
        num_layers=1,
        block_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype_bytes=2,
        key_layer_stride_bytes=10_000,
        key_block_stride_bytes=16,
        value_layer_stride_bytes=10_000,
        value_block_stride_bytes=16,
    )
    plan = plan_handoff(IDENT, [[500]], [[600]], 4, r, hidden_state_bytes=4)
    assert descriptors(plan)[0].source_offset_bytes == 500 * 16
    with pytest.raises(ValueError, match="allocated_blocks 16 < num_blocks 32"):
        region(32, allocated=16)
    with pytest.raises(ValueError, match="layers would overlap"):
        KVRegion(**(msgspec.structs.asdict(region(8)) | {"key_layer_stride_bytes": 7 * 32}))
    with pytest.raises(ValueError, match="blocks would overlap"):
        KVRegion(**(msgspec.structs.asdict(block_major(8)) | {"key_block_stride_bytes": 64}))
    with pytest.raises(ValueError, match="must be >= one block"):
        KVRegion(**(msgspec.structs.asdict(region(8)) | {"value_block_stride_bytes": 8}))
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        region(head_dim=0)
