"""Every workspace member's tests collect in an environment holding only that member, its locked
dependencies and its `dev` group, and the torch-free members stay torch-free there
(scripts/check_members.py; CI's per-member jobs also run the tests and install the wheels)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dependency_rules import TORCH_FREE, find_members

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_members.py"


def check_members(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_script_lists_every_workspace_member():
    listed = check_members("list", "--json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert sorted(json.loads(listed.stdout)) == sorted(m.name for m in find_members(REPO))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH (pip install uv)")
def test_every_member_collects_alone():
    result = check_members("test", "--collect-only")
    summary = result.stdout[result.stdout.rfind("\nmember ") :]
    assert result.returncode == 0, summary + result.stdout[-3000:] + result.stderr[-2000:]
    sections = {part.split(" ", 1)[0]: part for part in result.stdout.split("\n=== ")[1:]}
    assert set(sections) == {m.name for m in find_members(REPO)}
    for name in TORCH_FREE:
        assert "torch absent" in sections[name], sections[name][-2000:]
    assert "torch importable" in sections["rlt-attention"]
