"""Finds import circles among the source modules of packages/ and services/ (issue 40, item 7).

A circle is a group of modules each of which reaches every other through import statements:
neither side can be read, tested or changed alone. The graph is built from the source text:

- every `import a.b` and `from a.b import c` counts, at module level or inside a function
  (a deferred import only hides the circle from the interpreter, not from the reader);
- `from a.b import c` points at module `a.b.c` where that is a module, else at `a.b`;
  relative imports are resolved against the importing module;
- imports under `if TYPE_CHECKING:` count too: a module that needs another's types to be read
  still cannot be read alone, and hiding the import from the interpreter hides no dependency
  (move the shared type below both sides: a small types module or a Protocol);
- a package's `__init__` counts only where it is named (`from rlt_runner import X`), not for
  being executed on the way to a submodule: re-exporting from `__init__` is not a circle.

Only modules of the workspace's members are nodes (src/ trees); imports of anything else are
dropped. A circle is a strongly connected component with more than one module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("packages", "services")


@dataclass(frozen=True)
class Circle:
    modules: tuple[str, ...]  # sorted dotted names
    cycle: tuple[str, ...]  # one closed path through them, first module repeated at the end

    def __str__(self) -> str:
        return f"{len(self.modules)} modules: " + " -> ".join(self.cycle)


def source_modules(repo: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the members' src/ trees."""
    modules: dict[str, Path] = {}
    for group in GROUPS:
        for src in sorted((repo / group).glob("*/src")):
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it sits (functions, `if TYPE_CHECKING:` included)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The workspace modules that `module`'s import statements name."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            candidates = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            candidates = [c if c in modules else base for c in candidates] or [base]
        for name in candidates:
            # `import a.b.c` where only `a.b` is a workspace module still names `a.b`
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def import_graph(repo: Path) -> dict[str, set[str]]:
    modules = source_modules(repo)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest closed path from `start` back to itself inside `component`."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of its component")


def find_circles(repo: Path) -> list[Circle]:
    graph = import_graph(repo)
    circles = []
    for component in _components(graph):
        if len(component) > 1:
            cycle = _cycle_through(component[0], set(component), graph)
            circles.append(Circle(tuple(component), tuple(cycle)))
    return sorted(circles, key=lambda c: c.modules)
