"""Checks the monorepo's dependency rule on a source tree (used by test_dependency_rules.py).

Rules:
1. A distribution under packages/ may depend on no rlt distribution except rlt-contracts;
   only distributions under services/ combine several.
2. rlt-contracts depends on the standard library and msgspec only (no torch).
3. Every module a member's sources import (stdlib and the member itself aside) is declared in
   that member's own [project] dependencies: an import that only works because some other
   member pulled the distribution in is a violation too.
4. Every module a member's tests import is declared in its dependencies or its `dev` dependency
   group (its test-support modules aside): the member's tests run in an environment holding
   only the member, its dependencies and that group (scripts/check_members.py).
5. A member that depends on rlt-contracts declares a compatible range (lower and upper bound,
   e.g. `rlt-contracts>=0.1,<0.2`) that admits the workspace's rlt-contracts version; the range
   is bumped by the rule in packages/rlt-contracts/README.md.
6. The torch-free members (TORCH_FREE) have no torch in their locked dependencies (uv.lock).
7. The workspace's own `dev` group holds every member's `dev` requirement (the root run runs
   every member's tests).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

CONTRACTS = "rlt-contracts"
CONTRACTS_ALLOWED = {"msgspec"}
TORCH_FREE = frozenset({"rlt-contracts", "rlt-kv", "rlt-scheduler", "rlt-serve"})
UPPER_BOUNDS = {"<", "<=", "==", "~=", "==="}


@dataclass(frozen=True)
class Violation:
    member: str
    message: str

    def __str__(self) -> str:
        return f"{self.member}: {self.message}"


@dataclass(frozen=True)
class Member:
    name: str  # distribution name
    root: Path
    is_service: bool
    dependencies: frozenset[str]  # normalized distribution names
    version: str = "0"
    requirements: tuple[str, ...] = ()  # [project] dependencies as written
    dev: tuple[str, ...] = ()  # the `dev` dependency group as written


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def dependency_group(pyproject: dict, name: str) -> tuple[str, ...]:
    """A PEP 735 dependency group's requirements, `include-group` entries expanded."""
    found: list[str] = []
    for entry in pyproject.get("dependency-groups", {}).get(name, []):
        if isinstance(entry, str):
            found.append(entry)
        else:
            found.extend(dependency_group(pyproject, entry["include-group"]))
    return tuple(found)


def find_members(repo: Path) -> list[Member]:
    members = []
    for group in ("packages", "services"):
        for pyproject in sorted((repo / group).glob("*/pyproject.toml")):
            data = tomllib.loads(pyproject.read_text())
            project = data["project"]
            requirements = tuple(project.get("dependencies", []))
            members.append(
                Member(
                    normalize(project["name"]),
                    pyproject.parent,
                    group == "services",
                    frozenset(requirement_name(r) for r in requirements),
                    project.get("version", "0"),
                    requirements,
                    dependency_group(data, "dev"),
                )
            )
    return members


def imported_modules(source_root: Path) -> dict[str, Path]:
    """Top-level module name -> first file importing it (absolute imports only)."""
    found: dict[str, Path] = {}
    for path in sorted(source_root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path)
    return found


def own_modules(member: Member) -> set[str]:
    src = member.root / "src"
    return (
        {p.name for p in src.iterdir() if p.is_dir() or p.suffix == ".py"}
        if src.exists()
        else set()
    )


def distribution_of(module: str, mapping: dict[str, list[str]]) -> set[str]:
    if module.startswith("rlt_") or module == "rlt":
        return {normalize(module)}
    return {normalize(d) for d in mapping.get(module, [])} or {normalize(module)}


def find_violations(repo: Path) -> list[Violation]:
    mapping = packages_distributions()
    violations: list[Violation] = []
    members = find_members(repo)
    for member in members:
        rlt_deps = {d for d in member.dependencies if d == "rlt" or d.startswith("rlt-")}
        if member.name == CONTRACTS:
            extra = member.dependencies - CONTRACTS_ALLOWED
            if extra:
                violations.append(
                    Violation(member.name, f"may depend on msgspec only, declares {sorted(extra)}")
                )
        elif not member.is_service and rlt_deps - {CONTRACTS}:
            violations.append(
                Violation(
                    member.name,
                    "packages may depend only on rlt-contracts, declares "
                    f"{sorted(rlt_deps - {CONTRACTS})}",
                )
            )
        own = own_modules(member)
        for module, path in sorted(imported_modules(member.root / "src").items()):
            if module in own or module in sys.stdlib_module_names or module == "__future__":
                continue
            dists = distribution_of(module, mapping)
            if not dists & member.dependencies:
                rel = path.relative_to(repo)
                violations.append(
                    Violation(
                        member.name,
                        f"{rel} imports {module!r} but does not declare {sorted(dists)[0]}",
                    )
                )
            elif member.name == CONTRACTS and not dists & CONTRACTS_ALLOWED:
                violations.append(
                    Violation(member.name, f"imports {module!r}; contracts allow msgspec only")
                )
        violations += test_import_violations(repo, member, own, mapping)
        violations += contracts_range_violations(member, members)
    violations += torch_free_violations(repo)
    violations += workspace_dev_violations(repo, members)
    return violations


def test_import_violations(
    repo: Path, member: Member, own: set[str], mapping: dict[str, list[str]]
) -> list[Violation]:
    """Rule 4: what the member's tests import is declared in its dependencies or `dev` group."""
    tests = member.root / "tests"
    if not tests.exists():
        return []
    support = {p.stem for p in tests.rglob("*.py")} | {
        p.name for p in tests.rglob("*") if p.is_dir()
    }
    declared = member.dependencies | {requirement_name(r) for r in member.dev}
    violations = []
    for module, path in sorted(imported_modules(tests).items()):
        if (
            module in own
            or module in support
            or module in sys.stdlib_module_names
            or module == "__future__"
        ):
            continue
        dists = distribution_of(module, mapping)
        if not dists & declared:
            violations.append(
                Violation(
                    member.name,
                    f"{path.relative_to(repo)} imports {module!r} but neither the dependencies "
                    f"nor the dev group declare {sorted(dists)[0]}",
                )
            )
    return violations


def contracts_range_violations(member: Member, members: list[Member]) -> list[Violation]:
    """Rule 5: a compatible rlt-contracts range that admits the workspace's version."""
    contracts = next((m for m in members if m.name == CONTRACTS), None)
    violations = []
    for written in member.requirements:
        if contracts is None or requirement_name(written) != CONTRACTS:
            continue
        specifier = Requirement(written).specifier
        operators = {spec.operator for spec in specifier}
        if not specifier or operators <= {">", ">=", "!="} or not operators & UPPER_BOUNDS:
            violations.append(
                Violation(
                    member.name,
                    f"declares {written.strip()!r}: give a compatible range with an upper "
                    "bound, e.g. 'rlt-contracts>=0.1,<0.2' (packages/rlt-contracts/README.md)",
                )
            )
        elif not specifier.contains(Version(contracts.version), prereleases=True):
            violations.append(
                Violation(
                    member.name,
                    f"declares {written.strip()!r}, which excludes the workspace's rlt-contracts "
                    f"{contracts.version}: update the range (packages/rlt-contracts/README.md)",
                )
            )
    return violations


def locked_closure(lock: dict, name: str, groups: tuple[str, ...] = ("dev",)) -> set[str]:
    """Every package uv.lock installs for workspace member `name` with `groups` (markers
    ignored, extras followed: a superset)."""
    packages = {normalize(p["name"]): p for p in lock["package"]}
    first = packages[name]
    todo = [(d["name"], d.get("extra", [])) for d in first.get("dependencies", [])]
    for group in groups:
        todo += [
            (d["name"], d.get("extra", []))
            for d in first.get("dev-dependencies", {}).get(group, [])
        ]
    seen = {name}
    while todo:
        dep, extras = todo.pop()
        dep = normalize(dep)
        package = packages[dep]
        for extra in extras:
            for d in package.get("optional-dependencies", {}).get(extra, []):
                todo.append((d["name"], d.get("extra", [])))
        if dep in seen:
            continue
        seen.add(dep)
        todo += [(d["name"], d.get("extra", [])) for d in package.get("dependencies", [])]
    return seen


def torch_free_violations(repo: Path) -> list[Violation]:
    """Rule 6: the torch-free members' locked closure (with their dev group) has no torch."""
    lock_path = repo / "uv.lock"
    if not lock_path.exists():
        return []
    lock = tomllib.loads(lock_path.read_text())
    locked = {normalize(p["name"]) for p in lock["package"]}
    return [
        Violation(name, "is torch-free (TORCH_FREE) but its locked dependencies install torch")
        for name in sorted(TORCH_FREE & locked)
        if "torch" in locked_closure(lock, name)
    ]


def workspace_dev_violations(repo: Path, members: list[Member]) -> list[Violation]:
    """Rule 7: the root `dev` group covers every member's `dev` requirements (by name)."""
    root = repo / "pyproject.toml"
    if not root.exists():
        return []
    workspace = {
        requirement_name(r) for r in dependency_group(tomllib.loads(root.read_text()), "dev")
    }
    return [
        Violation(
            member.name,
            f"its dev group needs {requirement_name(r)}, which the workspace's dev group lacks",
        )
        for member in members
        for r in member.dev
        if requirement_name(r) not in workspace
    ]
