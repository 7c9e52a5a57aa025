"""Test support of rlt-pd: small KV regions, random block tables and a byte-level copy oracle."""

from __future__ import annotations

import random

from rlt_contracts import ExecutionIdentity
from rlt_pd import HandoffPlan, KVRegion, KVTensor, TransferDescriptor

IDENT = ExecutionIdentity("req", 3)
K, V = KVTensor.KEY, KVTensor.VALUE


def region(
    num_blocks: int = 32,
    *,
    layers: int = 3,
    block_size: int = 4,
    heads: int = 2,
    head_dim: int = 2,
    dtype_bytes: int = 2,
    allocated: int | None = None,
) -> KVRegion:
    return KVRegion.contiguous(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
        allocated_blocks=allocated,
    )


def block_major(num_blocks: int = 32, layers: int = 3) -> KVRegion:
    """[num_blocks, L, B, Hkv, D] (the anchor's layout), with padding between blocks."""
    block_bytes = 4 * 2 * 2 * 2
    return KVRegion(
        num_layers=layers,
        block_size=4,
        num_kv_heads=2,
        head_dim=2,
        dtype_bytes=2,
        key_layer_stride_bytes=block_bytes,
        key_block_stride_bytes=layers * block_bytes + 16,
        value_layer_stride_bytes=block_bytes + 8,
        value_block_stride_bytes=layers * (block_bytes + 8),
        num_blocks=num_blocks,
    )


def random_tables(rng: random.Random, planes: int, pages: int, num_blocks: int) -> list[list[int]]:
    blocks = rng.sample(range(num_blocks), planes * pages)
    return [blocks[p * pages : (p + 1) * pages] for p in range(planes)]


def simulate(
    plan: HandoffPlan,
    src_region: KVRegion,
    dst_region: KVRegion,
    src_tables,
    dst_tables,
    rng: random.Random,
) -> None:
    """Apply the plan to bytearrays and check it against a per-token oracle computed here."""
    src = {t: rng.randbytes(src_region.tensor_extent_bytes(t)) for t in KVTensor}
    dst = {t: bytearray(dst_region.tensor_extent_bytes(t)) for t in KVTensor}
    writes = {t: bytearray(len(dst[t])) for t in KVTensor}  # per-byte write count
    for partition in plan.partitions:
        for d in partition.descriptors:
            s, o, n = d.source_offset_bytes, d.destination_offset_bytes, d.length_bytes
            assert n > 0 and s + n <= len(src[d.tensor]) and o + n <= len(dst[d.tensor])
            dst[d.tensor][o : o + n] = src[d.tensor][s : s + n]
            for i in range(o, o + n):
                writes[d.tensor][i] += 1
    expected = {t: bytearray(len(dst[t])) for t in KVTensor}
    tb, bs = src_region.token_bytes, src_region.block_size
    for t in KVTensor:
        src_ls, src_bs = src_region.strides_bytes(t)
        dst_ls, dst_bs = dst_region.strides_bytes(t)
        for plane in range(plan.num_planes):
            for pos in range(plan.first_token, plan.valid_tokens):
                page, offset = divmod(pos, bs)
                for layer in range(src_region.num_layers):
                    so = layer * src_ls + src_tables[plane][page] * src_bs + offset * tb
                    do = layer * dst_ls + dst_tables[plane][page] * dst_bs + offset * tb
                    assert dst[t][do : do + tb] == src[t][so : so + tb], (t, plane, pos, layer)
                    expected[t][do : do + tb] = b"\x01" * tb
        assert writes[t] == expected[t], f"{t}: bytes outside the valid tokens written, or twice"


def expected_kv_bytes(valid: int, planes: int, r: KVRegion, first: int = 0) -> int:
    return (valid - first) * planes * r.num_layers * 2 * r.num_kv_heads * r.head_dim * r.dtype_bytes


def descriptors(plan: HandoffPlan) -> list[TransferDescriptor]:
    return [d for p in plan.partitions for d in p.descriptors]
