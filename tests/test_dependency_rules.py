"""The dependency rule holds for the repository, and the checker catches each kind of breach."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from dependency_rules import find_members, find_violations

REPO = Path(__file__).resolve().parents[1]


def test_repository_follows_the_dependency_rule():
    members = {m.name for m in find_members(REPO)}
    assert {
        "rlt-contracts",
        "rlt-scheduler",
        "rlt-kv",
        "rlt-attention",
        "rlt-runner",
        "rlt-models",
        "rlt-sampling",
        "rlt-pd",
        "rlt-serve",
        "rlt",
    } <= members
    assert [str(v) for v in find_violations(REPO)] == []


def write_member(repo: Path, group: str, name: str, deps: list[str], source: str) -> None:
    root = repo / group / name
    module = name.replace("-", "_")
    (root / "src" / module).mkdir(parents=True)
    dep_lines = ", ".join(f'"{d}"' for d in deps)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "0.1.0"\ndependencies = [{dep_lines}]\n'
    )
    (root / "src" / module / "__init__.py").write_text(textwrap.dedent(source))


@pytest.fixture
def clean_tree(tmp_path):
    write_member(
        tmp_path, "packages", "rlt-contracts", ["msgspec>=0.19"], "import msgspec\nimport enum\n"
    )
    write_member(tmp_path, "packages", "rlt-kv", ["rlt-contracts"], "from rlt_contracts import x\n")
    write_member(
        tmp_path,
        "packages",
        "rlt-scheduler",
        ["rlt-contracts", "torch>=2.11"],
        "import torch\nfrom rlt_scheduler import policy\n",
    )
    write_member(
        tmp_path,
        "services",
        "rlt",
        ["rlt-kv", "rlt-scheduler", "rlt-contracts"],
        "import rlt_kv, rlt_scheduler\n",
    )
    return tmp_path


def test_clean_fixture_tree_passes(clean_tree):
    assert find_violations(clean_tree) == []


def test_package_importing_another_package_fails(clean_tree):
    init = clean_tree / "packages/rlt-scheduler/src/rlt_scheduler/__init__.py"
    init.write_text(init.read_text() + "def f():\n    from rlt_kv.pool import BlockPool\n")
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-scheduler" and "'rlt_kv'" in violation.message


def test_package_declaring_another_package_fails(tmp_path):
    write_member(tmp_path, "packages", "rlt-contracts", ["msgspec"], "import msgspec\n")
    write_member(tmp_path, "packages", "rlt-runner", ["rlt-contracts", "rlt-kv"], "")
    [violation] = find_violations(tmp_path)
    assert "only on rlt-contracts" in violation.message and "rlt-kv" in violation.message


def test_undeclared_third_party_import_fails(clean_tree):
    (clean_tree / "packages/rlt-kv/src/rlt_kv/blocks.py").write_text("import numpy as np\n")
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "numpy" in violation.message


def test_contracts_importing_torch_fails(clean_tree):
    (clean_tree / "packages/rlt-contracts/src/rlt_contracts/t.py").write_text("import torch\n")
    messages = [v.message for v in find_violations(clean_tree)]
    assert any("torch" in m for m in messages)
    pyproject = clean_tree / "packages/rlt-contracts/pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('"msgspec>=0.19"', '"msgspec>=0.19", "torch"')
    )
    assert any("msgspec only" in v.message for v in find_violations(clean_tree))
