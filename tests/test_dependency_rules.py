"""The dependency rule holds for the repository, and the checker catches each kind of breach."""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import pytest
from dependency_rules import TORCH_FREE, find_members, find_violations, locked_closure

REPO = Path(__file__).resolve().parents[1]
CONTRACTS_RANGE = ["rlt-contracts>=0.1,<0.2"]


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
    # members are not bare: each workspace member declares a dev group for its own tests
    assert all("pytest" in " ".join(m.dev) for m in find_members(REPO))


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
    write_member(tmp_path, "packages", "rlt-kv", CONTRACTS_RANGE, "from rlt_contracts import x\n")
    write_member(
        tmp_path,
        "packages",
        "rlt-scheduler",
        [CONTRACTS_RANGE[0], "torch>=2.11"],
        "import torch\nfrom rlt_scheduler import policy\n",
    )
    write_member(
        tmp_path,
        "services",
        "rlt",
        ["rlt-kv", "rlt-scheduler", *CONTRACTS_RANGE],
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
    write_member(tmp_path, "packages", "rlt-runner", [CONTRACTS_RANGE[0], "rlt-kv"], "")
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


def write_tests(repo: Path, group: str, name: str, files: dict[str, str]) -> None:
    tests = repo / group / name / "tests"
    tests.mkdir(parents=True, exist_ok=True)
    for filename, source in files.items():
        (tests / filename).write_text(textwrap.dedent(source))


def add_dev_group(repo: Path, group: str, name: str, requirements: list[str]) -> None:
    pyproject = repo / group / name / "pyproject.toml"
    lines = ", ".join(f'"{r}"' for r in requirements)
    pyproject.write_text(pyproject.read_text() + f"\n[dependency-groups]\ndev = [{lines}]\n")


def test_tests_importing_an_undeclared_distribution_fail(clean_tree):
    write_tests(
        clean_tree,
        "packages",
        "rlt-kv",
        {"helper.py": "X = 1\n", "test_a.py": "import pytest\nimport helper\nimport rlt_kv\n"},
    )
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "'pytest'" in violation.message
    add_dev_group(clean_tree, "packages", "rlt-kv", ["pytest>=8"])
    assert find_violations(clean_tree) == []
    # a package's tests that drive the engine service need what the package may not declare
    (clean_tree / "packages/rlt-kv/tests/test_b.py").write_text("from rlt import LLM\n")
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "'rlt'" in violation.message


def set_contracts(repo: Path, member: str, requirement: str, version: str = "0.1.0") -> None:
    contracts = repo / "packages/rlt-contracts/pyproject.toml"
    contracts.write_text(
        re.sub(r'version = "[^"]*"', f'version = "{version}"', contracts.read_text())
    )
    pyproject = repo / "packages" / member / "pyproject.toml"
    pyproject.write_text(re.sub(r'"rlt-contracts[^"]*"', f'"{requirement}"', pyproject.read_text()))


@pytest.mark.parametrize("requirement", ["rlt-contracts", "rlt-contracts>=0.1"])
def test_contracts_without_a_compatible_range_fails(clean_tree, requirement):
    set_contracts(clean_tree, "rlt-kv", requirement)
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "upper bound" in violation.message


def test_contracts_range_admitting_the_workspace_version_passes(clean_tree):
    set_contracts(clean_tree, "rlt-kv", "rlt-contracts>=0.1,<0.2", version="0.1.3")
    assert [str(v) for v in find_violations(clean_tree)] == []


def test_contracts_range_excluding_the_workspace_version_fails(clean_tree):
    # a breaking change bumps rlt-contracts to 0.2.0; every dependent still says <0.2
    set_contracts(clean_tree, "rlt-kv", "rlt-contracts>=0.1,<0.2", version="0.2.0")
    violations = find_violations(clean_tree)
    assert {v.member for v in violations} == {"rlt-kv", "rlt-scheduler", "rlt"}
    assert all("excludes the workspace's rlt-contracts 0.2.0" in v.message for v in violations)
    for member in ("rlt-kv", "rlt-scheduler"):
        set_contracts(clean_tree, member, "rlt-contracts>=0.2,<0.3", version="0.2.0")
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt"


def test_workspace_dev_group_must_cover_members_dev_groups(clean_tree):
    (clean_tree / "pyproject.toml").write_text('[dependency-groups]\ndev = ["pytest>=8"]\n')
    add_dev_group(clean_tree, "packages", "rlt-kv", ["pytest>=8", "numpy"])
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "numpy" in violation.message


def test_torch_free_member_whose_lock_pulls_torch_fails(clean_tree):
    lock = """
        version = 1
        [[package]]
        name = "rlt-kv"
        version = "0.1.0"
        dependencies = [{ name = "rlt-contracts" }, { name = "helper", extra = ["gpu"] }]
        [[package]]
        name = "rlt-contracts"
        version = "0.1.0"
        dependencies = [{ name = "msgspec" }]
        [[package]]
        name = "msgspec"
        version = "0.19.0"
        [[package]]
        name = "helper"
        version = "1.0"
        [package.optional-dependencies]
        gpu = [{ name = "torch" }]
        [[package]]
        name = "torch"
        version = "2.11.0"
    """
    (clean_tree / "uv.lock").write_text(textwrap.dedent(lock))
    [violation] = find_violations(clean_tree)
    assert violation.member == "rlt-kv" and "torch" in violation.message


def test_workspace_torch_free_members_have_no_torch_in_the_lock():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    for name in sorted(TORCH_FREE):
        closure = locked_closure(lock, name)
        assert "pytest" in closure and "torch" not in closure, name
    assert "torch" in locked_closure(lock, "rlt-attention")


def test_no_module_outside_rlt_models_names_a_family():
    from family_names import family_name_breaches, find_family_name_breaches

    assert find_family_name_breaches(REPO) == []
    # the checker sees names, imports and literals, and lets docstrings explain
    source = (
        '"""Ouro is one family."""\nfrom rlt_models import OuroConfig\n'
        'if name == "nanbeige": x.dory_loops = 1\n'
    )
    found = family_name_breaches(source, Path("pkg/mod.py"))
    assert [b.split(": ", 1)[1] for b in found] == ["'OuroConfig'", "'nanbeige'", "'dory_loops'"]


def test_no_import_circles_in_packages_or_services():
    """Issue 40, item 7: no group of modules imports itself round (import_circles.py)."""
    from import_circles import find_circles

    circles = [str(c) for c in find_circles(REPO)]
    assert circles == [], "import circles (move the shared part below both sides):\n" + "\n".join(
        circles
    )


def write_modules(repo: Path, modules: dict[str, str]) -> None:
    """Source files of one member, rlt-x: {"a.py": source, "sub/__init__.py": source}."""
    src = repo / "packages/rlt-x/src/rlt_x"
    for name, source in {"__init__.py": "", **modules}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(textwrap.dedent(source))


def test_circle_checker_names_each_circle_through_any_import(tmp_path):
    from import_circles import find_circles

    write_modules(
        tmp_path,
        {
            # a -> b at module level, b -> a inside a function: one circle
            "a.py": "from rlt_x.b import f\n",
            "b.py": "def f():\n    from rlt_x import a\n    return a\n",
            # c -> sub.d (relative), sub.d -> c (`import rlt_x.c.thing`: the module rlt_x.c)
            "c.py": "from .sub import d\n",
            "sub/__init__.py": "",
            "sub/d.py": "import rlt_x.c.thing\n",
            # e -> a only: reaches the circle, is not on it
            "e.py": "import rlt_x.a\n",
        },
    )
    found = find_circles(tmp_path)
    assert [c.modules for c in found] == [("rlt_x.a", "rlt_x.b"), ("rlt_x.c", "rlt_x.sub.d")]
    assert [str(c) for c in found] == [
        "2 modules: rlt_x.a -> rlt_x.b -> rlt_x.a",
        "2 modules: rlt_x.c -> rlt_x.sub.d -> rlt_x.c",
    ]


def test_circle_checker_ignores_package_reexports(tmp_path):
    from import_circles import find_circles

    write_modules(
        tmp_path,
        {
            # the package re-exports b; b importing a sibling runs __init__, names no circle
            "__init__.py": "from rlt_x.b import B\n",
            "a.py": "A = 1\n",
            "b.py": "from rlt_x.a import A\nB = A\n",
            "c.py": "from rlt_x.b import B\nC = B\n",
        },
    )
    assert find_circles(tmp_path) == []


@pytest.mark.parametrize(
    "type_import",
    [
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlt_x.c import C\n",
        "import typing\nif typing.TYPE_CHECKING:\n    import rlt_x.c\n",
    ],
)
def test_circle_checker_counts_type_checking_imports(tmp_path, type_import):
    """A module that needs another's types to be read cannot be read alone either: an import
    under `if TYPE_CHECKING:` closes a circle like any other (issue 40: the runner had two such
    circles, cut by a small types module and a Protocol below both sides)."""
    from import_circles import find_circles

    write_modules(
        tmp_path,
        {
            "b.py": type_import + "B = 1\n",
            "c.py": "from rlt_x.b import B\nC = B\n",
        },
    )
    assert [c.modules for c in find_circles(tmp_path)] == [("rlt_x.b", "rlt_x.c")]
