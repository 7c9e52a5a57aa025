"""The one PDL switch both kernel packages read: RLT_PDL (read at import) and `set_enabled` (which
wins over it), never under the Triton interpreter; RLT_PDL_TRIGGER picks the order of the two
instructions; the launch keyword only when on. (That each package's kernels follow it is
checked in rlt-models' and rlt-attention's test_grid_dependency.py; that PDL launches compute
the same tokens, on CUDA by tests/test_cuda_engine.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from rlt_contracts import dependent_launch


@pytest.fixture(autouse=True)
def default_switch(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    yield
    dependent_launch.set_enabled(None)


def test_environment_variable(monkeypatch):
    monkeypatch.delenv(dependent_launch.ENV, raising=False)
    assert dependent_launch.requested_by_environment()
    monkeypatch.setenv(dependent_launch.ENV, "0")
    assert not dependent_launch.requested_by_environment()
    monkeypatch.setenv(dependent_launch.ENV, "1")
    assert dependent_launch.requested_by_environment()


def test_override_wins_over_the_environment_until_reset(monkeypatch):
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert dependent_launch.requested()
    dependent_launch.set_enabled(False)
    assert not dependent_launch.requested()
    monkeypatch.setattr(dependent_launch, "_environment", False)  # RLT_PDL=0 at import
    dependent_launch.set_enabled(None)
    assert not dependent_launch.requested()
    dependent_launch.set_enabled(True)
    assert dependent_launch.requested()


def test_never_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRETED", True)
    dependent_launch.set_enabled(True)
    assert not dependent_launch.requested()


def test_capability_and_launch_keyword():
    assert [dependent_launch.supports(major) for major in (7, 8, 9, 10)] == [
        False,
        False,
        True,
        True,
    ]
    assert dependent_launch.launch_options(False) == {}
    assert dependent_launch.launch_options(True) == {"launch_pdl": True}


@pytest.mark.parametrize(
    ("trigger", "expected"),
    [
        (None, ("griddepcontrol.launch_dependents", "griddepcontrol.wait")),
        ("early", ("griddepcontrol.launch_dependents", "griddepcontrol.wait")),
        ("after_wait", ("griddepcontrol.wait", "griddepcontrol.launch_dependents")),
    ],
)
def test_trigger_order_from_the_environment(monkeypatch, trigger, expected):
    """Read at import, so each setting in a fresh interpreter."""
    if trigger is None:
        monkeypatch.delenv(dependent_launch.TRIGGER_ENV, raising=False)
    else:
        monkeypatch.setenv(dependent_launch.TRIGGER_ENV, trigger)
    code = (
        "from rlt_contracts import dependent_launch as d\n"
        "print(' | '.join(i.split(';')[0] for i in d.GRID_DEPENDENCY_INSTRUCTIONS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert tuple(out.stdout.strip().split(" | ")) == expected
