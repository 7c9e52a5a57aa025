"""The runner boundary: no module of the service layer (`services/*/src`) reads the runner's
device state except through what the runner declares for it (for PD, its `pd_regions`, an
`rlt_contracts.PDMemorySource`: addresses, layout and a request's row).

A breach, found in the source's syntax tree:
- naming a KV tensor or the landing buffer (`key_cache`, `value_cache`, `key_scale`,
  `value_scale`, `landing`, `tensors`), as an attribute or a string literal (getattr);
- reading a device-state owner from a runner (`<...runner>.kv`, `.rows`, `.snapshots`,
  `.program`, `.bookkeeping`, `.position_loops`, where the object is named `runner` or
  `_runner`, as `self._runner` or `core.runner`);
- importing the runner's state modules (`rlt_runner.kv_storage`, `.row_state`, `.row_record`) or
  classes (`DecodeRows`, `RowRecord`, `KVCacheTensors`).
Docstrings and comments may name them. `core.kv` (the logical KV manager) and `pending.rows`
(a count) are not the runner's, so they pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

TENSOR_NAMES = {"key_cache", "value_cache", "key_scale", "value_scale", "landing", "tensors"}
RUNNER_STATE = {"kv", "rows", "snapshots", "program", "bookkeeping", "position_loops"}
STATE_MODULES = {"rlt_runner.kv_storage", "rlt_runner.row_state", "rlt_runner.row_record"}
STATE_CLASSES = {"DecodeRows", "RowRecord", "KVCacheTensors"}


def _owner_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def boundary_breaches(source: str, path: Path) -> list[str]:
    """`path:line: what` for every breach in one module's source."""
    found = []

    def breach(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{node.lineno}: {what}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in TENSOR_NAMES:
                breach(node, f"reads {node.attr!r}")
            elif node.attr in RUNNER_STATE and _owner_name(node.value).endswith("runner"):
                breach(node, f"reads the runner's {node.attr!r}")
        elif isinstance(node, ast.Constant) and node.value in TENSOR_NAMES:
            breach(node, f"names {node.value!r}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in STATE_MODULES:
                    breach(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if node.module in STATE_MODULES or names & STATE_CLASSES:
                breach(node, f"imports {node.module} {sorted(names)}")
    return found


def find_boundary_breaches(repo: Path) -> list[str]:
    found = []
    for path in sorted(repo.glob("services/*/src/**/*.py")):
        found += boundary_breaches(path.read_text(), path.relative_to(repo))
    return found
