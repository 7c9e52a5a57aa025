#!/usr/bin/env python3
"""Each workspace member on its own: its tests in an environment holding only that member, and
its wheel and sdist installed alone in a clean virtual environment.

    python3 scripts/check_members.py list [--json]
    python3 scripts/check_members.py test  [--collect-only] [--env-root DIR] [MEMBER ...]
    python3 scripts/check_members.py build [--out DIR] [MEMBER ...]

MEMBER is a distribution name (`rlt-kv`, `rlt`) or a member folder (`packages/rlt-kv`); none
means every member. Standard library only (CI runs it before anything is synced); needs `uv`.

`test`, per member, with UV_PROJECT_ENVIRONMENT=DIR/<member> (never the workspace's .venv):
    uv sync --locked --package MEMBER --no-default-groups --group dev
        (an exact sync: the member, its locked dependencies and its `dev` group, nothing else)
    checks the environment: no rlt distribution beyond the member's declared closure, and torch
        not importable where the locked closure has no torch
    DIR/<member>/bin/python -m pytest MEMBER_FOLDER   (from the repository root)
        fails on any non-zero exit, 5 ("no tests collected") included, and on tests skipped by
        `pytest.importorskip` (a dependency the member's tests need is not declared)

`build`, per member:
    uv build --package MEMBER --out-dir OUT/dist           (the sdist, then the wheel from it)
    for the wheel and for the sdist: a fresh `uv venv`, `uv pip install` of the artifact plus the
        built wheels of the rlt members it depends on (rlt-contracts is not on PyPI; everything
        else comes from PyPI), then import it from outside the repository with PYTHONPATH unset
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENV_ROOT = REPO / "build" / "members"
DEFAULT_BUILD_OUT = REPO / "build" / "member-dist"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


@dataclass(frozen=True)
class Member:
    name: str  # normalized distribution name
    root: Path
    version: str
    dependencies: tuple[str, ...]  # normalized names of [project] dependencies
    modules: tuple[str, ...]  # top-level import names under src/

    @property
    def folder(self) -> str:
        return self.root.relative_to(REPO).as_posix()


def find_members() -> dict[str, Member]:
    workspace = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]
    members: dict[str, Member] = {}
    for pattern in workspace["members"]:
        for folder in sorted(glob.glob(str(REPO / pattern))):
            pyproject = Path(folder) / "pyproject.toml"
            if not pyproject.exists():
                continue
            project = tomllib.loads(pyproject.read_text())["project"]
            src = pyproject.parent / "src"
            modules = tuple(sorted(p.name for p in src.iterdir() if (p / "__init__.py").exists()))
            name = normalize(project["name"])
            members[name] = Member(
                name,
                pyproject.parent,
                project["version"],
                tuple(requirement_name(r) for r in project.get("dependencies", [])),
                modules,
            )
    return members


def rlt_closure(member: Member, members: dict[str, Member]) -> set[str]:
    """The member and every workspace member it depends on, transitively."""
    seen, todo = set(), [member.name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(d for d in members[name].dependencies if d in members)
    return seen


def locked_closure(member: str, groups: tuple[str, ...] = ("dev",)) -> set[str]:
    """Every package uv.lock installs for `member` with `groups` (markers ignored, extras
    followed: a superset). The same walk as tests/dependency_rules.py's."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    packages = {normalize(p["name"]): p for p in lock["package"]}

    def edges(entries):
        return [(d["name"], d.get("extra", [])) for d in entries]

    first = packages[member]
    todo = edges(first.get("dependencies", []))
    for group in groups:
        todo += edges(first.get("dev-dependencies", {}).get(group, []))
    seen = {member}
    while todo:
        name, extras = todo.pop()
        package = packages[normalize(name)]
        for extra in extras:
            todo += edges(package.get("optional-dependencies", {}).get(extra, []))
        if normalize(name) in seen:
            continue
        seen.add(normalize(name))
        todo += edges(package.get("dependencies", []))
    return seen


def select(members: dict[str, Member], wanted: list[str]) -> list[Member]:
    if not wanted:
        return list(members.values())
    by_folder = {m.folder: m for m in members.values()}
    chosen = []
    for item in wanted:
        key = item.rstrip("/")
        member = members.get(normalize(key)) or by_folder.get(key)
        if member is None:
            sys.exit(f"unknown member {item!r}; members: {', '.join(members)}")
        chosen.append(member)
    return chosen


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment minus what would leak other code into a member's environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT"}
        and not k.startswith("PYTEST_")
    }
    env.update(extra)
    return env


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, **kw)


def uv() -> str:
    found = shutil.which("uv")
    if found is None:
        sys.exit("uv is not on PATH (python3 -m pip install uv)")
    return found


# --------------------------------------------------------------------------------------- test


def check_environment(member: Member, members: dict[str, Member], python: Path) -> list[str]:
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, re\n"
        "names = sorted({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower()"
        " for d in m.distributions()})\n"
        "print(json.dumps({'dists': names, 'torch': u.find_spec('torch') is not None}))\n"
    )
    out = subprocess.run(
        [str(python), "-c", probe], env=clean_env(), cwd=REPO, capture_output=True, text=True
    )
    if out.returncode != 0:
        return [f"probing the environment failed: {out.stderr.strip()}"]
    found = json.loads(out.stdout)
    problems = []
    allowed = rlt_closure(member, members)
    extra = sorted(set(found["dists"]) & set(members) - allowed)
    if extra:
        problems.append(f"environment holds rlt members it does not declare: {extra}")
    if "torch" not in locked_closure(member.name) and found["torch"]:
        problems.append("torch is importable, but nothing the member declares needs it")
    print(
        f"  environment: {len(found['dists'])} distributions, rlt members "
        f"{sorted(set(found['dists']) & set(members))}, torch "
        f"{'importable' if found['torch'] else 'absent'}",
        flush=True,
    )
    return problems


def importorskip_skips(junit: Path) -> list[str]:
    if not junit.exists():
        return []
    found = []
    for case in ET.parse(junit).iter("testcase"):
        for skipped in case.iter("skipped"):
            message = f"{skipped.get('message', '')} {skipped.text or ''}".strip()
            if "could not import" in message:
                found.append(f"{case.get('classname')}::{case.get('name')}: {message}")
    return found


def counts(junit: Path) -> str:
    suites = list(ET.parse(junit).iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return f"{total - skipped} passed, {skipped} skipped"


def test_member(
    member: Member, members: dict[str, Member], env_root: Path, collect_only: bool, pytest_args
) -> tuple[bool, float, str]:
    started = time.monotonic()
    venv = env_root / member.name
    env = clean_env(UV_PROJECT_ENVIRONMENT=str(venv))
    sync = [uv(), "sync", "--locked", "--package", member.name, "--no-default-groups"]
    if run([*sync, "--group", "dev"], env=env).returncode != 0:
        return False, time.monotonic() - started, "uv sync failed"
    problems = check_environment(member, members, venv / "bin" / "python")
    if problems:
        return False, time.monotonic() - started, "; ".join(problems)
    junit = venv / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [venv / "bin" / "python", "-m", "pytest", member.folder, "-p", "no:cacheprovider"]
    cmd += ["--collect-only", "-q"] if collect_only else [f"--junitxml={junit}"]
    status = run([*cmd, *pytest_args], env=clean_env()).returncode
    elapsed = time.monotonic() - started
    if status == 5:
        return False, elapsed, "pytest collected no tests (exit code 5)"
    if status != 0:
        return False, elapsed, f"pytest exit code {status}"
    if collect_only:
        return True, elapsed, "collected"
    skipped = importorskip_skips(junit)
    if skipped:
        return False, elapsed, "tests skipped for a missing module: " + "; ".join(skipped)
    return True, elapsed, counts(junit)


# -------------------------------------------------------------------------------------- build


def artifacts(dist: Path, member: Member) -> tuple[Path, Path]:
    stem = member.name.replace("-", "_")
    [wheel] = dist.glob(f"{stem}-{member.version}-*.whl")
    [sdist] = dist.glob(f"{stem}-{member.version}.tar.gz")
    return wheel, sdist


def build_member(
    member: Member, members: dict[str, Member], out: Path, python: str
) -> tuple[bool, float, str]:
    started = time.monotonic()
    dist = out / "dist"
    results = []
    for dep in sorted(rlt_closure(member, members)):
        stem = members[dep].name.replace("-", "_")
        if not list(dist.glob(f"{stem}-{members[dep].version}*")):
            cmd = [uv(), "build", "--package", dep, "--out-dir", dist, "--no-create-gitignore"]
            if run(cmd, env=clean_env()).returncode != 0:
                return False, time.monotonic() - started, f"uv build --package {dep} failed"
    wheel, sdist = artifacts(dist, member)
    others = [
        artifacts(dist, members[d])[0] for d in sorted(rlt_closure(member, members) - {member.name})
    ]
    for kind, artifact in (("wheel", wheel), ("sdist", sdist)):
        venv = out / "venvs" / f"{member.name}-{kind}"
        shutil.rmtree(venv, ignore_errors=True)
        env = clean_env()
        if run(
            [uv(), "venv", "--no-project", "--python", python, venv], env=env, cwd=out
        ).returncode:
            return False, time.monotonic() - started, f"uv venv failed ({kind})"
        install = [uv(), "pip", "install", "--python", venv / "bin" / "python", artifact, *others]
        if run(install, env=env, cwd=out).returncode != 0:
            return False, time.monotonic() - started, f"installing the {kind} failed"
        probe = (
            "import importlib, importlib.metadata as m, sys\n"
            f"names, dist = {list(member.modules)!r}, {member.name!r}\n"
            "for name in names:\n"
            "    module = importlib.import_module(name)\n"
            "    assert module.__file__.startswith(sys.prefix), (name, module.__file__)\n"
            "print(dist, m.version(dist), 'from', sys.prefix, 'imports', *names)\n"
        )
        if run([venv / "bin" / "python", "-c", probe], env=env, cwd=out).returncode != 0:
            return False, time.monotonic() - started, f"importing from the {kind} failed"
        results.append(kind)
    return True, time.monotonic() - started, " and ".join(results) + " install alone and import"


# --------------------------------------------------------------------------------------- main


def report(rows: list[tuple[str, bool, float, str]]) -> int:
    print("\nmember                  result   time    detail")
    for name, ok, seconds, detail in rows:
        print(f"{name:<23} {'ok' if ok else 'FAIL':<8} {seconds:6.1f}s  {detail}")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="the workspace members")
    listing.add_argument("--json", action="store_true", help="a JSON list (a CI matrix)")
    test = sub.add_parser("test", help="each member's tests in an environment of its own")
    test.add_argument("members", nargs="*")
    test.add_argument("--env-root", type=Path, default=DEFAULT_ENV_ROOT)
    test.add_argument("--collect-only", action="store_true")
    test.add_argument("--pytest-arg", action="append", default=[], dest="pytest_args")
    build = sub.add_parser("build", help="wheel and sdist of each member, installed alone")
    build.add_argument("members", nargs="*")
    build.add_argument("--out", type=Path, default=DEFAULT_BUILD_OUT)
    build.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)

    members = find_members()
    if args.command == "list":
        names = list(members)
        print(json.dumps(names) if args.json else "\n".join(names))
        return 0
    rows = []
    if args.command == "test":
        args.env_root.mkdir(parents=True, exist_ok=True)
        for member in select(members, args.members):
            print(f"\n=== {member.name} ({member.folder})", flush=True)
            ok, seconds, detail = test_member(
                member, members, args.env_root.resolve(), args.collect_only, args.pytest_args
            )
            rows.append((member.name, ok, seconds, detail))
    else:
        out = args.out.resolve()
        shutil.rmtree(out / "dist", ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        for member in select(members, args.members):
            print(f"\n=== {member.name} ({member.folder})", flush=True)
            rows.append((member.name, *build_member(member, members, out, args.python)))
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
