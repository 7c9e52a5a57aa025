"""Runner device state: KV storage copies, slots and block tables, snapshots, batch metadata,
memory planning and graph buckets (CPU tensors; no model needed)."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import BlockTableUpdate, ExecutionIdentity, SamplingParams
from rlt_runner import KVStorage, RequestSlots, SnapshotStore, plan_kv_blocks
from rlt_runner.attention_batches import decode_batch, prefill_batch
from rlt_runner.decode_graphs import bucket_sizes

B = 4  # block size


def storage(num_blocks: int = 16) -> KVStorage:
    kv = KVStorage(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=B,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv.tensors.key_cache.copy_(torch.randn_like(kv.tensors.key_cache))
    kv.tensors.value_cache.copy_(torch.randn_like(kv.tensors.value_cache))
    return kv


def slots(planes: int = 2) -> RequestSlots:
    return RequestSlots(
        max_requests=3,
        num_planes=planes,
        max_pages=8,
        hidden_size=5,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def ident(name: str) -> ExecutionIdentity:
    return ExecutionIdentity(name, 0)


def test_scratch_block_lies_outside_the_logical_pool():
    kv = storage(num_blocks=16)
    assert kv.tensors.key_cache.shape[1] == 17 and kv.scratch_block == 16 and kv.scratch_slot == 64
    assert KVStorage.bytes_per_block(24, 16, 16, 128, torch.bfloat16) == 3 * 1024 * 1024


def test_copy_slots_copies_every_layer_and_nothing_else():
    kv = storage()
    before_k = kv.tensors.key_cache.clone()
    kv.copy_slots(torch.tensor([5, 5]), torch.tensor([9, 13]))
    flat_k = kv.tensors.key_cache.flatten(1, 2)
    assert torch.equal(flat_k[:, 9], flat_k[:, 5]) and torch.equal(flat_k[:, 13], flat_k[:, 5])
    untouched = [s for s in range(flat_k.shape[1]) if s not in (9, 13)]
    assert torch.equal(flat_k[:, untouched], before_k.flatten(1, 2)[:, untouched])


def test_slots_assign_release_and_block_tables():
    table = slots()
    a = table.assign(ident("a"), SamplingParams())
    table.apply_block_updates(
        ident("a"), (BlockTableUpdate(0, 0, (3, 4)), BlockTableUpdate(1, 0, (7, 8)))
    )
    table.apply_block_updates(
        ident("a"), (BlockTableUpdate(0, 2, (5,)), BlockTableUpdate(1, 2, (9,)))
    )
    assert table.state(ident("a")).host_tables == [[3, 4, 5], [7, 8, 9]]
    assert table.block_tables[a.slot, 1, :3].tolist() == [7, 8, 9]
    assert table.slot_of_position(ident("a"), 1, 9, B) == 9 * B + 1  # page 2 of plane 1
    with pytest.raises(RuntimeError, match="already has"):
        table.assign(ident("a"), SamplingParams())
    table.release(ident("a"))
    assert ident("a") not in table and table.assign(ident("b"), SamplingParams()).slot == a.slot


def test_snapshot_restores_kv_into_new_blocks_with_hidden_and_token():
    kv, table, store = storage(), slots(), SnapshotStore()
    a = table.assign(ident("a"), SamplingParams(seed=5))
    table.apply_block_updates(
        ident("a"), (BlockTableUpdate(0, 0, (1, 2)), BlockTableUpdate(1, 0, (3, 4)))
    )
    table.hidden[a.slot] = torch.arange(5.0)
    table.pending_token[a.slot] = 42
    saved_k, saved_v = kv.read_blocks([1, 2, 3, 4])
    saved_k, saved_v = saved_k.clone(), saved_v.clone()
    store.save(ident("a"), table, kv)
    assert ident("a") not in table and ident("a") in store
    kv.tensors.key_cache.zero_()  # the old blocks are reused by others meanwhile
    table.assign(ident("a"), store.sampling_of(ident("a")))
    table.apply_block_updates(
        ident("a"), (BlockTableUpdate(0, 0, (10, 11)), BlockTableUpdate(1, 0, (12, 13)))
    )
    store.restore(ident("a"), table, kv)
    new_k, new_v = kv.read_blocks([10, 11, 12, 13])
    assert torch.equal(new_k, saved_k) and torch.equal(new_v, saved_v)
    slot = table.state(ident("a")).slot
    assert table.hidden[slot].tolist() == [0, 1, 2, 3, 4] and int(table.pending_token[slot]) == 42
    assert len(store) == 0 and table.state(ident("a")).sampling.seed == 5


def test_decode_batch_metadata_reads_each_rows_plane():
    table = slots()
    table.assign(ident("a"), SamplingParams())
    table.assign(ident("b"), SamplingParams())
    table.apply_block_updates(
        ident("a"), (BlockTableUpdate(0, 0, (1, 2, 3)), BlockTableUpdate(1, 0, (4, 5, 6)))
    )
    table.apply_block_updates(
        ident("b"), (BlockTableUpdate(0, 0, (7,)), BlockTableUpdate(1, 0, (8,)))
    )
    slot_ids = torch.tensor([table.state(ident("a")).slot, table.state(ident("b")).slot])
    batch = decode_batch(
        table, slot_ids, torch.tensor([1, 0]), torch.tensor([9, 2]), block_size=B, max_position=9
    )
    assert batch.query_start.tolist() == [0, 1, 2] and batch.context_lengths.tolist() == [10, 3]
    assert batch.block_tables.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert batch.write_slots.tolist() == [6 * B + 1, 7 * B + 2]


def test_prefill_batch_packs_groups_in_order():
    table = slots(planes=1)
    table.assign(ident("a"), SamplingParams())
    table.apply_block_updates(ident("a"), (BlockTableUpdate(0, 0, (2, 3)),))
    slot = table.state(ident("a")).slot
    batch = prefill_batch(table, [slot], 0, [3], [3], block_size=B, device=torch.device("cpu"))
    assert batch.query_start.tolist() == [0, 3] and batch.context_lengths.tolist() == [6]
    assert batch.write_slots.tolist() == [2 * B + 3, 3 * B + 0, 3 * B + 1]
    assert (batch.max_query_len, batch.max_context_len) == (3, 6)


def cpu_plan(*, useful_blocks: int, cpu_budget_bytes: int, explicit_blocks: int | None = None):
    return plan_kv_blocks(
        device=torch.device("cpu"),
        bytes_per_block=100,
        useful_blocks=useful_blocks,
        explicit_blocks=explicit_blocks,
        gpu_memory_utilization=0.9,
        activation_reserve_bytes=0,
        cpu_budget_bytes=cpu_budget_bytes,
    )


def test_memory_plan_sources_and_caps():
    plan = cpu_plan(useful_blocks=50, cpu_budget_bytes=1000)
    assert (plan.num_blocks, plan.source, plan.total_bytes) == (10, "cpu_budget", 1000)
    assert cpu_plan(useful_blocks=5, cpu_budget_bytes=1000).num_blocks == 5
    explicit = cpu_plan(useful_blocks=5, cpu_budget_bytes=0, explicit_blocks=7)
    assert (explicit.num_blocks, explicit.source) == (7, "explicit")
    with pytest.raises(MemoryError, match="no memory left"):
        cpu_plan(useful_blocks=5, cpu_budget_bytes=50)


def test_graph_buckets_are_powers_of_two_capped_by_max_rows():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
