"""Checks the monorepo's dependency rule on a source tree (used by test_dependency_rules.py).

Rules:
1. A distribution under packages/ may depend on no rlt distribution except rlt-contracts;
   only distributions under services/ combine several.
2. rlt-contracts depends on the standard library and msgspec only (no torch).
3. Every module a member's sources import (stdlib and the member itself aside) is declared in
   that member's own [project] dependencies: an import that only works because some other
   member pulled the distribution in is a violation too.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

CONTRACTS = "rlt-contracts"
CONTRACTS_ALLOWED = {"msgspec"}


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


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def find_members(repo: Path) -> list[Member]:
    members = []
    for group in ("packages", "services"):
        for pyproject in sorted((repo / group).glob("*/pyproject.toml")):
            project = tomllib.loads(pyproject.read_text())["project"]
            deps = frozenset(requirement_name(r) for r in project.get("dependencies", []))
            members.append(
                Member(normalize(project["name"]), pyproject.parent, group == "services", deps)
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
    for member in find_members(repo):
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
    return violations
