"""Issue 40, item 3: the service layer reads the runner's device state only through the
interface the runner declares (runner_boundary.py), and the checker catches each kind of
breach."""

from __future__ import annotations

from pathlib import Path

from runner_boundary import boundary_breaches, find_boundary_breaches

REPO = Path(__file__).resolve().parents[1]


def test_no_service_module_reads_runner_or_kv_tensors():
    assert find_boundary_breaches(REPO) == []


def test_the_checker_names_each_kind_of_breach():
    source = '''
"""The landing buffer and key_cache may be named here."""
from rlt_runner.row_state import DecodeRows
from rlt_runner import ModelRunner, RowRecord
import rlt_runner.kv_storage

def wire(core, runner):
    keys = runner.kv.tensors.key_cache  # three breaches on one line
    row = core.runner.rows.record(identity).row
    hidden = getattr(self._runner.rows, "landing")
'''
    found = [b.split(": ", 1)[1] for b in boundary_breaches(source, Path("m.py"))]
    assert sorted(found) == sorted(
        [
            "imports rlt_runner.row_state ['DecodeRows']",
            "imports rlt_runner ['ModelRunner', 'RowRecord']",
            "imports rlt_runner.kv_storage",
            "reads 'key_cache'",
            "reads 'tensors'",
            "reads the runner's 'kv'",
            "reads the runner's 'rows'",
            "reads the runner's 'rows'",
            "names 'landing'",
        ]
    )


def test_the_declared_interface_and_look_alikes_pass():
    source = """
from rlt_runner import KVStorage, ModelRunner

def wire(core, runner, pending, role, identity):
    memory = runner.pd_regions.memory(role)  # the declared interface
    row = core.runner.pd_regions.hidden_row(identity)
    free = core.kv.capacity().free_blocks  # the logical KV manager, not the runner's
    rows = pending.rows  # a step's row count
    size = KVStorage.bytes_per_block(2, 16, 4, 64, None)  # sizing, no tensor
    return memory.kv.key.address, memory.hidden.row_bytes
"""
    assert boundary_breaches(source, Path("m.py")) == []
