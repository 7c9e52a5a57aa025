"""`StepBookkeeping` failure protocol on CPU tensors (R04): a failed snapshot or restore drops
only that request's device state and names it; work for a lost request is skipped until the
scheduler releases it; a failed shared operation raises for the caller to fail the step."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import (
    BlockTableUpdate,
    DecodeRule,
    ExecutionIdentity,
    ExitRule,
    ExitRuleKind,
    FailedOperation,
    NewRequestData,
    RequestBlocks,
    SamplingParams,
    SchedulerOutput,
)
from rlt_runner import DecodeRows, KVStorage, SnapshotStore
from rlt_runner.step_bookkeeping import StepBookkeeping

RULE = DecodeRule(ExitRule(ExitRuleKind.HAZARD, 2, 4, 1.0), max_tokens=7)
A, V = ExecutionIdentity("a", 0), ExecutionIdentity("v", 1)


def make() -> StepBookkeeping:
    cpu = torch.device("cpu")
    kv = KVStorage(
        num_layers=1,
        num_blocks=8,
        block_size=2,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=cpu,
    )
    rows = DecodeRows(
        max_rows=2,
        num_planes=1,
        max_pages=4,
        hidden_size=3,
        dtype=torch.float32,
        device=cpu,
        scratch_block=8,
    )
    return StepBookkeeping(rows, kv, SnapshotStore())


def admit(identity: ExecutionIdentity, blocks: tuple[int, ...]) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=0,
        new_requests=(NewRequestData(identity, SamplingParams(seed=1), 3, RULE),),
        block_updates=(RequestBlocks(identity, (BlockTableUpdate(0, 0, blocks),)),),
    )


def boom(*args, **kwargs):
    raise RuntimeError("injected")


def test_a_failed_snapshot_loses_only_the_victim_until_its_release(monkeypatch):
    book = make()
    book.apply(admit(A, (0, 1)))
    book.apply(admit(V, (2, 3)))
    monkeypatch.setattr(book.snapshots, "save", boom)
    failures = book.apply(SchedulerOutput(step_id=1, snapshots=(V,)))
    assert [(f.identities, f.operation) for f in failures] == [((V,), FailedOperation.SNAPSHOT)]
    assert V not in book.rows and V not in book.snapshots and A in book.rows
    assert not book.is_live(V)
    # A step scheduled before the failure was known still restores V: skipped, not a crash.
    book.apply(
        SchedulerOutput(
            step_id=2,
            restores=(V,),
            block_updates=(RequestBlocks(V, (BlockTableUpdate(0, 0, (4, 5)),)),),
        )
    )
    assert V not in book.rows
    book.apply(SchedulerOutput(step_id=3, released=(V,)))
    assert book.lost == frozenset()


def test_a_failed_restore_loses_only_the_resumed_request(monkeypatch):
    book = make()
    book.apply(admit(V, (2, 3)))
    assert book.apply(SchedulerOutput(step_id=1, snapshots=(V,))) == []
    monkeypatch.setattr(book.snapshots, "restore", boom)
    failures = book.apply(
        SchedulerOutput(
            step_id=2,
            restores=(V,),
            block_updates=(RequestBlocks(V, (BlockTableUpdate(0, 0, (4, 5)),)),),
        )
    )
    assert [(f.identities, f.operation) for f in failures] == [((V,), FailedOperation.RESTORE)]
    assert V not in book.rows and V not in book.snapshots and not book.is_live(V)


def test_a_failed_shared_operation_raises_for_the_step(monkeypatch):
    book = make()
    monkeypatch.setattr(book.rows, "apply_block_updates", boom)
    with pytest.raises(RuntimeError, match="injected"):
        book.apply(admit(A, (0, 1)))
    book.lose([A])
    assert A not in book.rows and not book.is_live(A)
    monkeypatch.undo()
    book.apply(admit(ExecutionIdentity("b", 2), (0, 1)))  # both rows are free again
    book.apply(admit(ExecutionIdentity("c", 3), (2, 3)))
    assert len(book.rows) == 2
