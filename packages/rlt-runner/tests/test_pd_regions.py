"""`PDRegions`: what the runner declares for PD. The declared addresses and layout reach the
runner's own bytes (read back through the addresses, as a transport reads them), each role
gets its hidden rows, the stage plane is declared, and a request's row is reported."""

from __future__ import annotations

import ctypes

import pytest
import torch
from rlt_contracts import DecodeRule, ExecutionIdentity, ExitRule, ExitRuleKind, PDRole
from rlt_contracts import SamplingParams as Sampling
from rlt_runner import DecodeRows, KVScales, KVStorage, PDRegions, RowRecord
from rlt_runner.pd_regions import memory_region

LAYERS, BLOCKS, BLOCK, HEADS, HEAD_DIM, ROWS, HIDDEN = 3, 6, 4, 2, 5, 3, 7


def storage(dtype=torch.float32, scales=None) -> KVStorage:
    kv = KVStorage(
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
        scales=scales,
    )
    for tensor in (kv.tensors.key_cache, kv.tensors.value_cache):
        tensor.copy_(torch.randn(tensor.shape).to(dtype))
    return kv


def rows(stage_planes: int = 0) -> DecodeRows:
    table = DecodeRows(
        max_rows=ROWS,
        num_planes=2 + stage_planes,
        stage_planes=stage_planes,
        max_pages=4,
        hidden_size=HIDDEN,
        dtype=torch.float32,
        device=torch.device("cpu"),
        scratch_block=BLOCKS,
    )
    table.hidden.copy_(torch.randn(ROWS, HIDDEN))
    table.landing.copy_(torch.randn(ROWS, HIDDEN))
    return table


def read(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


def test_declared_offsets_reach_every_position_of_the_runner_kv():
    kv = storage()
    memory = PDRegions(kv, rows()).memory(PDRole.PREFILL)
    pool = memory.kv
    assert (pool.allocated_blocks, pool.scratch_blocks, pool.num_blocks) == (7, 1, 6)
    assert (pool.num_planes, pool.stage_plane, pool.dtype, pool.scales) == (2, None, "float32", ())
    for region, tensor in ((pool.key, kv.tensors.key_cache), (pool.value, kv.tensors.value_cache)):
        for layer, block, position in [(0, 0, 0), (2, 6, 3), (1, 3, 2)]:
            at = region.address + pool.offset_bytes(layer, block, position)
            expected = tensor[layer, block, position].numpy().tobytes()
            assert read(at, pool.token_bytes) == expected
        block = read(region.address + pool.offset_bytes(1, 4), pool.block_bytes)
        assert block == tensor[1, 4].numpy().tobytes()  # a block of a layer is one range


def test_each_role_declares_its_hidden_rows_and_none_declares_nothing():
    table = rows()
    regions = PDRegions(storage(), table)
    for role, tensor in ((PDRole.PREFILL, table.hidden), (PDRole.DECODE, table.landing)):
        hidden = regions.memory(role).hidden
        assert (hidden.num_rows, hidden.row_bytes, hidden.dtype) == (ROWS, HIDDEN * 4, "float32")
        assert read(hidden.row_address(2), hidden.row_bytes) == tensor[2].numpy().tobytes()
    with pytest.raises(ValueError, match="without a PD role"):
        regions.memory(PDRole.NONE)


def test_the_stage_plane_and_an_fp8_cache_are_declared():
    scales = KVScales(key=(0.5, 1.0, 2.0), value=(1.5, 0.25, 1.0))
    regions = PDRegions(storage(torch.float8_e4m3fn, scales), rows(stage_planes=1))
    pool = regions.memory(PDRole.DECODE).kv
    assert (pool.num_planes, pool.stage_plane) == (3, 2)
    assert (pool.dtype, pool.element_bytes) == ("float8_e4m3fn", 1)
    assert pool.scales == (0.5, 1.0, 2.0, 1.5, 0.25, 1.0)


def test_a_request_row_is_reported_while_it_has_one():
    table = rows()
    regions = PDRegions(storage(), table)
    identity = ExecutionIdentity("r", 0)
    assert regions.hidden_row(identity) is None
    rule = DecodeRule(ExitRule(ExitRuleKind.HAZARD, 1, 2, 0.5), max_tokens=4)
    table.assign([RowRecord(ExecutionIdentity("other", 0), -1, Sampling(), rule, 3)])
    table.assign([RowRecord(identity, -1, Sampling(), rule, prompt_length=3)])
    assert regions.hidden_row(identity) == 1
    table.release([identity])
    assert regions.hidden_row(identity) is None


def test_a_strided_view_is_not_declared():
    with pytest.raises(ValueError, match="hidden rows is not contiguous"):
        memory_region("hidden rows", torch.zeros(4, 6).t())
