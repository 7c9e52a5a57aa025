"""The family rule: outside rlt-models no source names a model family (model-families.md).

Code reads a family's declaration (`rlt_contracts.FamilyDeclaration`) instead of testing its
name: an identifier, an import or a string literal that names a family anywhere else is a
breach. Docstrings and comments may name families (they explain, they do not branch). The one
exception is the table of the exit policies' earlier names (`POLICY_ALIASES`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

FAMILY_NAME = re.compile(r"(?i)(ouro|nanbeige|dory|hrm[_-]?text|huginn|raven)")
EXCEPTIONS = {
    ("rlt_contracts/scheduler_config.py", "POLICY_ALIASES"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _excepted(path: Path, tree: ast.AST) -> set[int]:
    """Nodes inside an excepted assignment (by file suffix and target name)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            str(path).endswith(suffix) and isinstance(t, ast.Name) and t.id == name
            for t in node.targets
            for suffix, name in EXCEPTIONS
        ):
            skipped |= {id(n) for n in ast.walk(node.value)}
    return skipped


def family_name_breaches(source: str, path: Path) -> list[str]:
    tree = ast.parse(source)
    ignored = _docstrings(tree) | _excepted(path, tree)
    breaches = []
    for node in ast.walk(tree):
        if id(node) in ignored:
            continue
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if FAMILY_NAME.search(text):
            breaches.append(f"{path}:{getattr(node, 'lineno', '?')}: {text[:60]!r}")
    return breaches


def find_family_name_breaches(repo: Path) -> list[str]:
    roots = [*repo.glob("packages/*/src"), *repo.glob("services/*/src")]
    breaches = []
    for root in roots:
        if root.parent.name == "rlt-models":
            continue
        for path in sorted(root.rglob("*.py")):
            breaches += family_name_breaches(path.read_text(), path.relative_to(repo))
    return breaches
