"""Rebuild a slim copy of the `ray` wheel: what Ray Serve on one node loads, and nothing else.

Why: the GPU machine has no package registry, so Ray travels as wheels in the working tree,
which may carry at most 64 MiB together with the repository itself (~21 MB tracked) and `.whl`
(~12 MB). The ray 2.60.0 cp312 manylinux wheel is 79 MB: the Java jars (31 MB compressed), the
dashboard's web client build, the ML libraries (rllib, tune, train, data, llm, air, workflow)
and three unstripped native programs (gcs_server, raylet, _raylet.so: 115 MB unpacked, of which
~32 MB are symbol tables).

Dropped (`DROPPED`, paths inside the wheel):
- `ray/jars/` (the Java worker and its jars),
- `ray/dashboard/client/` (the web UI's build; the dashboard's Python modules stay: the
  per-node dashboard agent and the runtime-env agent start even with include_dashboard=False),
- `ray/rllib/`, `ray/tune/`, `ray/train/`, `ray/data/`, `ray/llm/`, `ray/air/`,
  `ray/workflow/` (the libraries; Serve, the core and the dashboard agent import none of them:
  only dashboard *head* modules for train/data do, and the head is not started),
- `ray/serve/llm/` (imports `ray.llm`), the Cython headers (`ray/includes/`, `*.pxd`) and
  `ray/setup-dev.py`,
- the `tune` console script (entry_points.txt).
Kept: the core (`ray/_raylet.so`, `ray/core/`: gcs_server, raylet, libjemalloc, the generated
protobuf modules), `ray/_private/` (with the runtime-env agent's `thirdparty_files`),
`ray/_common/`, `ray/serve/`, `ray/dag/`, `ray/experimental/`, `ray/autoscaler/`,
`ray/dashboard/` (Python), `ray/util/`, `ray/widgets/`, `ray/scripts/` (the `ray` CLI:
`ray stop --force`), `ray/thirdparty_files/` (psutil, colorama), ... everything else.

`--strip` (default on) runs `strip --strip-unneeded` over every ELF file kept: the static
symbol tables go (crash stack traces show addresses instead of names), the dynamic symbols
that loading needs stay. `--compression lzma` (default) stores the members LZMA-compressed
instead of deflated: ~25% smaller on the native programs; `pip install` reads it (Python's
zipfile does), a strict installer may not; `--compression deflate` writes a standard wheel.
The dist-info is the original's with a fresh RECORD (sha256 of every member), the same version
and Requires-Dist (install it with --no-deps), and a REPACKED note. Result for 2.60.0 cp312:
75.6 MiB -> 23.4 MiB (deflate: 32.0 MiB), 1,095 files kept.

Run (here; the input is a downloaded wheel):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --abi cp312 --platform manylinux2014_x86_64 -d /tmp/raywhl ray==2.60.0
    uv run python tools/repack_ray_wheel.py .whlray \\
        --wheel /tmp/raywhl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl

`bash tools/fetch_device_wheels.sh ray` does both, and fetches the wheels of what Ray
Serve needs that the GPU image lacks. `--check PYTHON` installs the slim wheel with that
interpreter's pip (as the device does: --no-index --no-deps --target) into a temporary folder
and runs a smoke test: `ray.init(num_cpus=2, include_dashboard=False)`, a Serve deployment that
answers an HTTP request, `serve.shutdown()`, `ray.shutdown()`. Its dependencies must be
importable by PYTHON (its environment, or `--check-path DIR`, prepended to PYTHONPATH).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROPPED = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/tune/",
    "ray/train/",
    "ray/data/",
    "ray/llm/",
    "ray/air/",
    "ray/workflow/",
    "ray/serve/llm/",
    "ray/includes/",
    "ray/setup-dev.py",
)
DROPPED_SUFFIXES = (".pxd",)
DROPPED_SCRIPTS = ("tune",)  # console scripts whose module is dropped
DATE = (2020, 1, 1, 0, 0, 0)


def dropped(path: str) -> bool:
    return path.startswith(DROPPED) or path.endswith(DROPPED_SUFFIXES)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def strip_elf(data: bytes, strip: str) -> bytes:
    """`strip --strip-unneeded` over one ELF file's bytes (the input when strip fails)."""
    with tempfile.TemporaryDirectory(prefix="strip-") as tmp:
        source, target = Path(tmp, "in"), Path(tmp, "out")
        source.write_bytes(data)
        done = subprocess.run(
            [strip, "--strip-unneeded", "-o", str(target), str(source)], capture_output=True
        )
        if done.returncode != 0:
            print(f"  strip failed ({done.stderr.decode().strip()}): kept as is", file=sys.stderr)
            return data
        return target.read_bytes()


def _entry_points(text: str) -> str:
    lines = []
    for line in text.splitlines(keepends=True):
        name = line.split("=", 1)[0].strip()
        if "=" in line and name in DROPPED_SCRIPTS:
            continue
        lines.append(line)
    return "".join(lines)


def repack(wheel: Path, out_dir: Path, strip: str | None, compression: int) -> dict:
    archive = zipfile.ZipFile(wheel)
    infos = [i for i in archive.infolist() if not i.is_dir()]
    tops = {i.filename.split("/")[0] for i in infos}
    dist_info = next(t for t in sorted(tops) if t.endswith(".dist-info"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise SystemExit("the output folder holds the input wheel: choose another")
    records, stats = [], {"dropped": {}, "stripped_bytes": 0, "kept_files": 0}
    with zipfile.ZipFile(target, "w", compression, compresslevel=9) as out:

        def add(info: zipfile.ZipInfo, data: bytes) -> None:
            member = zipfile.ZipInfo(info.filename, date_time=DATE)
            member.external_attr = info.external_attr or (0o644 << 16)
            member.compress_type = compression
            out.writestr(member, data)
            records.append((info.filename, _record_hash(data), str(len(data))))

        for info in infos:
            path = info.filename
            if path.startswith(f"{dist_info}/"):
                continue
            if dropped(path):
                top = next((p for p in DROPPED if path.startswith(p)), "*.pxd")
                stats["dropped"][top] = stats["dropped"].get(top, 0) + info.file_size
                continue
            data = archive.read(info)
            if strip and _is_elf(data):
                slim = strip_elf(data, strip)
                stats["stripped_bytes"] += len(data) - len(slim)
                data = slim
            add(info, data)
            stats["kept_files"] += 1
        for name in ("WHEEL", "METADATA", "top_level.txt", "entry_points.txt"):
            info = zipfile.ZipInfo(f"{dist_info}/{name}")
            try:
                data = archive.read(info.filename)
            except KeyError:
                continue
            if name == "entry_points.txt":
                data = _entry_points(data.decode()).encode()
            add(info, data)
        for info in infos:  # the licenses
            if info.filename.startswith(f"{dist_info}/licenses/"):
                add(info, archive.read(info))
        note = {
            "by": "tools/repack_ray_wheel.py",
            "from": wheel.name,
            "dropped": list(DROPPED) + [f"*{s}" for s in DROPPED_SUFFIXES],
            "stripped": bool(strip),
            "compression": "lzma" if compression == zipfile.ZIP_LZMA else "deflate",
        }
        add(zipfile.ZipInfo(f"{dist_info}/REPACKED"), json.dumps(note, indent=1).encode())
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerows(records)
        writer.writerow((f"{dist_info}/RECORD", "", ""))
        record = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=DATE)
        record.compress_type = compression
        out.writestr(record, buffer.getvalue())
    stats["wheel"] = str(target)
    stats["input_bytes"] = wheel.stat().st_size
    stats["output_bytes"] = target.stat().st_size
    return stats


# -- smoke test ----------------------------------------------------------------------------------

SMOKE = r"""
import json, os, sys, time, urllib.request
import ray
from ray import serve
root = os.environ["SLIM_ROOT"]
assert ray.__file__.startswith(root), ("not the slim copy", ray.__file__)
start = time.perf_counter()
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=os.environ["SMOKE_TMP"])
port = int(os.environ.get("SMOKE_PORT", "8766"))
serve.start(http_options={"host": "127.0.0.1", "port": port})

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.5})
class Echo:
    async def __call__(self, request):
        body = await request.json()
        return {"echo": body["x"], "pid": os.getpid()}

serve.run(Echo.bind(), name="smoke", route_prefix="/")
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/", data=json.dumps({"x": 41}).encode(),
    headers={"content-type": "application/json"})
answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
assert answer["echo"] == 41, answer
serve.shutdown()
ray.shutdown()
print(f"slim ray OK: Serve answered {answer} ({time.perf_counter() - start:.1f} s)", flush=True)
"""


def check(wheel: Path, python: str, paths: list[str]) -> bool:
    with tempfile.TemporaryDirectory(prefix="slim-ray-") as root:
        install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        install += ["--no-cache-dir", "--target", root, str(wheel)]
        if subprocess.run(install).returncode != 0:
            return False
        env = dict(os.environ, SLIM_ROOT=root, PYTHONPATH=os.pathsep.join([root, *paths]))
        env["PATH"] = f"{root}/bin{os.pathsep}{env['PATH']}"
        # a session folder of its own (not /tmp/ray, which other clusters here may use);
        # ray.shutdown() stops this cluster's processes: no `ray stop`, which ends them all
        env["SMOKE_TMP"] = tempfile.mkdtemp(prefix="rs", dir="/tmp")
        done = subprocess.run([python, "-c", SMOKE], env=env, timeout=300)
        logs = Path(env["SMOKE_TMP"], "session_latest", "logs")
        missing = sorted(
            {
                line.split(" -- ", 1)[1].split(" cannot be loaded")[0]
                for log in logs.glob("*.log")
                for line in log.read_text(errors="replace").splitlines()
                if "cannot be loaded because" in line and "_head" not in line
            }
        )
        if missing:  # agent modules (the head is not started) that found no dependency
            print("agent modules not loaded:", *missing, sep="\n  ")
        shutil.rmtree(env["SMOKE_TMP"], ignore_errors=True)
        return done.returncode == 0 and not missing


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring."
    )
    parser.add_argument("out_dir", type=Path, help="folder for the slim wheel (created)")
    parser.add_argument("--wheel", type=Path, required=True, help="the ray wheel to repack")
    parser.add_argument(
        "--no-strip", dest="strip", action="store_false", help="keep the ELF symbol tables"
    )
    parser.add_argument("--compression", choices=("lzma", "deflate"), default="lzma")
    parser.add_argument("--check", metavar="PYTHON", help="smoke-test with this interpreter")
    parser.add_argument("--check-path", action="append", default=[], metavar="DIR")
    args = parser.parse_args(argv)

    strip = shutil.which("strip") if args.strip else None
    if args.strip and not strip:
        raise SystemExit("no `strip` on PATH (binutils); pass --no-strip")
    compression = zipfile.ZIP_LZMA if args.compression == "lzma" else zipfile.ZIP_DEFLATED
    stats = repack(args.wheel, args.out_dir, strip, compression)
    print(f"{args.wheel.name}: {_mib(stats['input_bytes'])} -> {_mib(stats['output_bytes'])}")
    stripped = _mib(stats["stripped_bytes"])
    print(f"  {stats['kept_files']} files kept; ELF symbols stripped: {stripped}")
    for top, size in sorted(stats["dropped"].items(), key=lambda kv: -kv[1]):
        print(f"  dropped {top}: {_mib(size)} unpacked")
    print(f"  -> {stats['wheel']}")
    if args.check and not check(Path(stats["wheel"]), args.check, args.check_path):
        print("--check FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
