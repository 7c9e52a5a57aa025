"""Runner device state: KV storage copies, rows and block tables, snapshots, prefill metadata,
memory planning and graph buckets (CPU tensors; no model needed)."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import (
    BlockTableUpdate,
    DecodeRule,
    ExecutionIdentity,
    ExitRule,
    ExitRuleKind,
    SamplingParams,
)
from rlt_runner import DecodeRows, KVStorage, RowRecord, SnapshotStore, plan_kv_blocks
from rlt_runner.decode_graphs import bucket_sizes
from rlt_runner.prefill import PrefillGroups

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


def rows(planes: int = 2, max_rows: int = 3) -> DecodeRows:
    return DecodeRows(
        max_rows=max_rows,
        num_planes=planes,
        max_pages=8,
        hidden_size=5,
        dtype=torch.float32,
        device=torch.device("cpu"),
        scratch_block=16,
        stop_capacity=3,
        trace_capacity=6,
    )


def ident(name: str) -> ExecutionIdentity:
    return ExecutionIdentity(name, 0)


RULE = DecodeRule(ExitRule(ExitRuleKind.HAZARD, 2, 4, 0.5), max_tokens=7, stop_token_ids=(0, 9))


def record(name: str, rule: DecodeRule = RULE, **sampling) -> RowRecord:
    return RowRecord(ident(name), -1, SamplingParams(**sampling), rule, prompt_length=3)


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


def test_rows_are_assigned_lowest_first_with_rule_and_sampling_on_the_device():
    table = rows()
    table.assign([record("a", seed=11, temperature=0.7, top_k=5)])
    table.assign([record("b")])
    a, b = table.record(ident("a")), table.record(ident("b"))
    assert (a.row, b.row) == (0, 1)
    assert table.seed[0].item() == 11 and table.top_k[0].item() == 5
    assert table.temperature[0].item() == pytest.approx(0.7)
    assert table.stop_ids[1].tolist() == [0, 9, -1]
    assert (table.min_loops[1].item(), table.max_loops[1].item()) == (2, 4)
    assert table.threshold[1].item() == 0.5 and table.max_tokens[1].item() == 7
    assert not table.active.any() and table.survival.tolist() == [1.0, 1.0, 1.0]
    table.release([ident("a")])
    table.assign([record("c")])
    assert table.record(ident("c")).row == 0  # the freed row is reused first
    with pytest.raises(RuntimeError, match="already has"):
        table.assign([record("c")])


def test_block_tables_grow_on_host_and_device_and_start_at_scratch():
    table = rows()
    table.assign([record("a")])
    table.apply_block_updates(
        [(ident("a"), (BlockTableUpdate(0, 0, (3, 4)), BlockTableUpdate(1, 0, (7, 8))))]
    )
    table.apply_block_updates(
        [(ident("a"), (BlockTableUpdate(0, 2, (5,)), BlockTableUpdate(1, 2, (9,))))]
    )
    a = table.record(ident("a"))
    assert a.host_tables == [[3, 4, 5], [7, 8, 9]]
    assert table.block_tables[a.row, 1].tolist() == [7, 8, 9] + [16] * 5
    assert table.allocated_tokens(a, B) == 3 * B


def test_trace_rows_need_room_for_their_depths():
    table = rows()
    trace = DecodeRule(ExitRule(ExitRuleKind.TRACE, 1, 4, trace_depths=(4, 3, 2)), max_tokens=3)
    table.assign([record("t", trace)])
    assert table.trace[0].tolist() == [4, 3, 2, 4, 4, 4]  # padded with max_loops
    too_long = DecodeRule(ExitRule(ExitRuleKind.TRACE, 1, 4, trace_depths=(4,) * 7), 7)
    with pytest.raises(ValueError, match="trace capacity"):
        table.assign([record("u", too_long)])


def test_snapshot_restores_kv_pages_and_progress_into_a_new_row():
    kv, table, store = storage(), rows(), SnapshotStore()
    table.assign([record("x"), record("a", seed=5)])
    table.apply_block_updates(
        [(ident("a"), (BlockTableUpdate(0, 0, (1, 2)), BlockTableUpdate(1, 0, (3, 4))))]
    )
    row = table.record(ident("a")).row
    table.hidden[row] = torch.arange(5.0)
    table.token[row], table.position[row], table.loops[row], table.outputs[row] = 42, 6, 2, 4
    table.survival[row], table.active[row] = 0.25, True
    saved_k, saved_v = kv.read_blocks(torch.tensor([1, 2, 3, 4]))
    store.save(ident("a"), table, kv)
    assert ident("a") not in table and ident("a") in store and not table.active[row]
    kv.tensors.key_cache.zero_()  # the old blocks are reused by others meanwhile
    table.release([ident("x")])
    table.assign([store.record_of(ident("a"))])
    table.apply_block_updates(
        [(ident("a"), (BlockTableUpdate(0, 0, (10, 11)), BlockTableUpdate(1, 0, (12, 13))))]
    )
    store.restore(ident("a"), table, kv)
    new_k, new_v = kv.read_blocks(torch.tensor([10, 11, 12, 13]))
    assert torch.equal(new_k, saved_k) and torch.equal(new_v, saved_v)
    new_row = table.record(ident("a")).row
    assert new_row == 0 != row
    assert table.hidden[new_row].tolist() == [0, 1, 2, 3, 4]
    progress = [table.token, table.position, table.loops, table.outputs]
    assert [int(t[new_row]) for t in progress] == [42, 6, 2, 4]
    assert table.survival[new_row].item() == 0.25 and bool(table.active[new_row])
    assert len(store) == 0 and table.seed[new_row].item() == 5


def test_prefill_groups_pack_queries_and_derive_each_planes_slots():
    table = rows()
    table.assign([record("a"), record("b")])
    table.apply_block_updates(
        [
            (ident("a"), (BlockTableUpdate(0, 0, (2, 3)), BlockTableUpdate(1, 0, (4, 5)))),
            (ident("b"), (BlockTableUpdate(0, 0, (6,)), BlockTableUpdate(1, 0, (7,)))),
        ]
    )
    groups = PrefillGroups(table, [0, 1], [3, 0], [3, 2], [9, 8, 7, 6, 5], block_size=B)
    plane0, plane1 = groups.batch(0), groups.batch(1)
    assert groups.query_start.tolist() == [0, 3, 5]
    assert groups.context_lengths.tolist() == [6, 2]
    assert groups.positions.tolist() == [3, 4, 5, 0, 1]
    assert plane0.write_slots.tolist() == [2 * B + 3, 3 * B, 3 * B + 1, 6 * B, 6 * B + 1]
    assert plane1.write_slots.tolist() == [4 * B + 3, 5 * B, 5 * B + 1, 7 * B, 7 * B + 1]
    assert groups.last_query.tolist() == [2, 4]
    assert (plane0.max_query_len, plane0.max_context_len) == (3, 6)


def cpu_plan(*, useful_blocks: int, cpu_budget_bytes: int, explicit_blocks: int | None = None):
    return plan_kv_blocks(
        device=torch.device("cpu"),
        bytes_per_block=100,
        useful_blocks=useful_blocks,
        explicit_blocks=explicit_blocks,
        gpu_memory_utilization=0.9,
        activation=None,
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


def test_cuda_pool_is_a_per_instance_share_capped_by_free_memory(monkeypatch):
    """vLLM's meaning: share x total minus this process's tensors, but never more than is
    free now (plus what torch caches unused). Another process's use lowers the pool only when
    the device is actually short, so two engines at 0.45 fit one GPU."""
    used = dict(free=600, allocated=80, reserved=100)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (used["free"], 1000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: used["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: used["reserved"])

    def blocks(share: float) -> int:
        return plan_kv_blocks(
            device=torch.device("cuda", 0),
            bytes_per_block=10,
            useful_blocks=1000,
            explicit_blocks=None,
            gpu_memory_utilization=share,
            activation=None,
            cpu_budget_bytes=0,
        ).num_blocks

    assert blocks(0.45) == 37  # (450 - 80) / 10: the other 300 in use elsewhere do not count
    used["free"] = 100  # the device is short: 100 free + 20 cached unused
    assert blocks(0.45) == 12


def test_graph_buckets_are_powers_of_two_capped_by_max_rows():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def test_a_pd_prefill_row_saves_no_logits_state():
    """A PD prefill row never samples on its instance, whose penalty and bitmask tensors may
    not exist: preempting it saves nothing of them (and does not fail)."""
    from rlt_runner.logits_state import LogitsState

    state = LogitsState(max_rows=2, vocab_size=8, eos_token_ids=(1,), device=torch.device("cpu"))
    rule = DecodeRule(ExitRule(ExitRuleKind.HAZARD, 2, 4, 1.0), max_tokens=4)
    penalized = SamplingParams(max_tokens=4, frequency_penalty=1.0)
    record = RowRecord(ExecutionIdentity("p", 0), 0, penalized, rule, 3, prefill_only=True)
    assert state.output_counts is None
    assert state.save_row(record) == {}
