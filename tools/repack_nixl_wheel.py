"""Rebuild slim copies of the `nixl` and `nixl-cu13` wheels that keep only NIXL's UCX backend.

Why: the GPU machine has no package registry, so NIXL travels as wheels in the working tree,
which may carry at most 64 MiB. The installed `nixl-cu13` 1.5.1 holds ~240 MB: every backend
plugin (GDS, GDS_MT, POSIX, OBJ, AZURE_BLOB, GPUNETIO, GUSLI, INFINIA, LIBFABRIC, ...), the
libraries only they need (AWS/Azure SDKs, libaio, liburing, libxml2, libcurl, ...), telemetry
exporters, three torch-specific builds of the expert-parallel extension `nixl_ep_cu13` (~95 MB),
example binaries, UCX's perftest modules and C++ headers. rlt-pd's `KVTransport` needs only the
Python bindings, libnixl and the UCX plugin (with UCX and its transport modules: cma/shm for
host memory, cuda/cuda_ipc for VRAM and NVLink, ib for RDMA).

What is kept, per flavour wheel (`nixl_cu13` here; `nixl_cu12` works the same way):
- the Python package (`nixl_cu13/`: `_api.py`, the `_bindings` and `_utils` extensions),
- `libplugin_UCX.so` from each plugin folder (`.nixl_cu13.mesonpy.libs/plugins/`, the one
  libnixl loads from, and the duplicate under `nixl_cu13.libs/nixl/`),
- UCX's transport modules (`nixl_cu13.libs/ucx/libuct_*.so`, `libucm_cuda.so`: UCX dlopens
  them by directory, so ELF dependencies cannot find them), except the perftest ones,
- the ELF `DT_NEEDED` closure of all of the above inside the wheel (libnixl, libserdes, UCX,
  etcd/grpc/protobuf/absl that libnixl links, libibverbs/mlx5 for UCX's ib module, ...),
- the dist-info, with a fresh RECORD (sha256 of every kept file) and the same version, so
  `nixl==1.5.1`'s pin on `nixl-cu13==1.5.1` still holds.
Dropped: everything else, including the `.data` folder (headers, example scripts, pkgconfig).
From the pure-Python `nixl` wheel: `nixl/` and `nixl_meta_utils.py` stay, `nixl_ep/` goes, and
the unconditional `Requires-Dist` on the other CUDA flavour is removed from METADATA.

Run (here; the input is the installed distributions of the interpreter that runs the script):

    uv run python tools/repack_nixl_wheel.py .whl            # slim wheels into .whl/
    uv run python tools/repack_nixl_wheel.py .whl --check    # + smoke-test them here

`--check` unpacks the slim wheels into a temporary folder, puts it first on PYTHONPATH and, in
a fresh interpreter, checks that NIXL lists only the UCX plugin, instantiates it, registers a
tensor and moves bytes with a WRITE between two agents (only when the wheel's Python tag is
this interpreter's). Input wheels instead of the installed files: `--wheel FILE.whl`
(repeatable), e.g. a cp312 wheel for the GPU machine, whose python3 is 3.12 (the installed
copy here is cp311 and its extensions do not load there):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 -d /tmp/nixl \\
        nixl-cu13==1.5.1 nixl==1.5.1
    uv run python tools/repack_nixl_wheel.py .whl --wheel /tmp/nixl/nixl_cu13-*.whl \\
        --wheel /tmp/nixl/nixl-1.5.1-*.whl

Carry to the GPU machine (see /work/.library/device/README.md): `.whl/` is git-ignored here,
so name it in the device call's `carry` (with the msgspec wheel rlt-contracts needs), and start
the command with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$(ls -d $PWD/packages/*/src \\
        $PWD/services/*/src | paste -sd:) NCCL_NVLS_ENABLE=0

then e.g. `python3 benchmarks/pd_transfer.py --device cuda:0,cuda:1` on `nvidia-h200-x2`.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

FLAVOURS = ("nixl_cu13", "nixl_cu12")
UCX_PLUGIN = "libplugin_UCX.so"
DROPPED_TOP_LEVEL = ("nixl_ep",)  # the expert-parallel packages (nixl_ep, nixl_ep_cu13)


# -- reading a distribution ----------------------------------------------------------------------


@dataclass
class Source:
    """One distribution's files: archive path -> reader, plus its metadata."""

    name: str  # normalized: nixl, nixl_cu13
    version: str
    dist_info: str  # e.g. nixl_cu13-1.5.1.dist-info
    files: dict[str, object] = field(default_factory=dict)  # path -> callable returning bytes
    origin: str = ""
    origin_bytes: int = 0  # installed bytes, or the input wheel's size

    def read(self, path: str) -> bytes:
        return self.files[path]()


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def from_installed(name: str) -> Source:
    dist = importlib.metadata.distribution(name)
    files = dist.files or []
    dist_info = next(str(f).split("/")[0] for f in files if ".dist-info/" in str(f))
    source = Source(_normalize(dist.metadata["Name"]), dist.version, dist_info)
    source.origin = str(Path(dist.locate_file("")).resolve())
    for f in files:
        path = str(f)
        if path.startswith("../") or "__pycache__" in path:  # scripts, headers, pkgconfig
            location = Path(dist.locate_file(f))
            if location.is_file():
                source.origin_bytes += location.stat().st_size
            continue
        location = Path(dist.locate_file(f))
        if not location.is_file():
            continue
        source.origin_bytes += location.stat().st_size
        source.files[path] = location.read_bytes
    return source


def from_wheel(path: Path) -> Source:
    archive = zipfile.ZipFile(path)
    names = archive.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    stem = dist_info.removesuffix(".dist-info")
    name, version = stem.rsplit("-", 1)
    source = Source(_normalize(name), version, dist_info, origin=str(path))
    source.origin_bytes = path.stat().st_size
    for n in names:
        if not n.endswith("/"):
            source.files[n] = lambda n=n: archive.read(n)
    return source


# -- ELF dependencies ----------------------------------------------------------------------------


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF file ([] for anything else)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    needed = []
    for section in sections:
        if section[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[section[6]][4]
        for j in range(section[5] // 16):
            tag, value = struct.unpack_from("<qQ", data, section[4] + 16 * j)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab + value
                needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def _is_shared_object(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return ".so" in base and not base.endswith(".la")


# -- choosing the files --------------------------------------------------------------------------


def keep_flavour(source: Source) -> tuple[set[str], list[str]]:
    """Files of a flavour wheel (nixl_cu13) to keep, and DT_NEEDED names not found in it."""
    pkg = source.name
    libs, meson = f"{pkg}.libs/", f".{pkg}.mesonpy.libs/"
    roots = set()
    for path in source.files:
        base = path.rsplit("/", 1)[-1]
        if path.startswith(f"{pkg}/"):
            roots.add(path)
        elif base == UCX_PLUGIN and (path.startswith(libs) or path.startswith(meson)):
            roots.add(path)
        elif path.startswith(f"{libs}ucx/") and _is_shared_object(path) and "perftest" not in base:
            roots.add(path)
    # index of every shared object by file name, excluding other plugins (never a dependency)
    by_name: dict[str, list[str]] = {}
    for path in source.files:
        if _is_shared_object(path) and "/plugins/" not in path and f"{libs}nixl/" not in path:
            by_name.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    keep, missing, todo = set(), set(), sorted(roots)
    while todo:
        path = todo.pop()
        if path in keep:
            continue
        keep.add(path)
        if not _is_shared_object(path):
            continue
        for name in elf_needed(source.read(path)):
            found = by_name.get(name)
            if found:
                todo.extend(found)
            else:
                missing.add(name)
    return keep, sorted(missing)


def keep_meta(source: Source) -> set[str]:
    return {
        p
        for p in source.files
        if not p.startswith(DROPPED_TOP_LEVEL)
        and ".dist-info/" not in p
        and not p.split("/")[0].endswith(".data")
    }


# -- writing the wheel ---------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _metadata(source: Source, flavour: str | None) -> bytes:
    text = source.read(f"{source.dist_info}/METADATA").decode()
    if source.name == "nixl" and flavour is not None:
        wanted = flavour.replace("_", "-")
        lines = []
        for line in text.splitlines(keepends=True):
            requirement = re.match(r"Requires-Dist:\s*(nixl-cu\d+|nixl-rocm)\b", line)
            if requirement and requirement.group(1) != wanted and "extra ==" not in line:
                continue  # the other flavour, required unconditionally
            lines.append(line)
        text = "".join(lines)
    return text.encode()


def write_wheel(source: Source, keep: set[str], out_dir: Path, flavour: str | None) -> Path:
    wheel_meta = source.read(f"{source.dist_info}/WHEEL").decode()
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")
    ]
    if not tags:
        raise SystemExit(f"{source.dist_info}/WHEEL names no Tag")
    parts = [list(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)]
    tag = "-".join(".".join(part) for part in parts)  # compressed tag set
    target = out_dir / f"{source.name}-{source.version}-{tag}.whl"
    records = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in sorted(keep):
            data = source.read(path)
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            executable = _is_shared_object(path) or path.rsplit("/", 1)[-1].startswith("lib")
            info.external_attr = (0o755 if executable else 0o644) << 16
            archive.writestr(info, data)
            records.append((path, _record_hash(data), str(len(data))))
        dist_info = f"{source.name}-{source.version}.dist-info"
        extras = {
            "METADATA": _metadata(source, flavour),
            "WHEEL": wheel_meta.encode(),
            "REPACKED": json.dumps(
                {
                    "by": "tools/repack_nixl_wheel.py",
                    "from": source.origin,
                    "kept": "the UCX backend only (see the script's docstring)",
                },
                indent=1,
            ).encode(),
        }
        for extra in ("top_level.txt", "licenses/LICENSE"):
            path = f"{source.dist_info}/{extra}"
            if path in source.files:
                extras[extra] = source.read(path)
        for name, data in extras.items():
            path = f"{dist_info}/{name}"
            archive.writestr(zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0)), data)
            records.append((path, _record_hash(data), str(len(data))))
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerows(records)
        writer.writerow((f"{dist_info}/RECORD", "", ""))
        archive.writestr(
            zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0)),
            buffer.getvalue(),
        )
    return target


# -- smoke test ----------------------------------------------------------------------------------

CHECK = r"""
import os, sys, time
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
import torch
import nixl, nixl_cu13
from nixl._api import nixl_agent, nixl_agent_config
root = os.environ["SLIM_ROOT"]
assert nixl_cu13.__file__.startswith(root), ("not the slim copy", nixl_cu13.__file__)
a = nixl_agent("slimA", nixl_agent_config(backends=[]))
b = nixl_agent("slimB", nixl_agent_config(backends=[]))
plugins = a.get_plugin_list()
assert plugins == ["UCX"], plugins
for agent in (a, b):
    agent.create_backend("UCX", dict(agent.get_plugin_params("UCX")))
src = torch.arange(4096, dtype=torch.int32)
dst = torch.zeros(4096, dtype=torch.int32)
a.register_memory([src]); b.register_memory([dst])
a.add_remote_agent(b.get_agent_metadata())
xfer = a.initialize_xfer("WRITE", a.get_xfer_descs([src]), b.get_xfer_descs([dst]), "slimB", b"n")
state = a.transfer(xfer)
deadline = time.monotonic() + 10
while state != "DONE" and time.monotonic() < deadline:
    state = a.check_xfer_state(xfer)
    assert state != "ERR"
assert state == "DONE" and torch.equal(src, dst), "the WRITE did not land"
print("slim NIXL OK: plugins", plugins, "- a UCX WRITE of", src.numel() * 4, "bytes landed")
"""


def check(wheels: list[Path]) -> bool:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    flavour = [w for w in wheels if w.name.startswith(FLAVOURS)]
    if not flavour or f"-{tag}-" not in flavour[0].name:
        print(f"--check skipped: the flavour wheel is not for this interpreter ({tag})")
        return True
    with tempfile.TemporaryDirectory(prefix="slim-nixl-") as root:
        for wheel in wheels:
            zipfile.ZipFile(wheel).extractall(root)
        for path in Path(root).rglob("*.so*"):
            path.chmod(0o755)
        env = dict(os.environ, PYTHONPATH=root, SLIM_ROOT=root)
        done = subprocess.run([sys.executable, "-c", CHECK], env=env)
        return done.returncode == 0


# -- main ----------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (top of this file) for what is kept and how to carry "
        "the wheels to the GPU machine.",
    )
    parser.add_argument("out_dir", type=Path, help="folder for the slim wheels (created)")
    parser.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=[],
        help="repack this wheel file instead of the installed distributions (repeatable)",
    )
    parser.add_argument(
        "--flavour",
        default=None,
        help="flavour distribution when repacking installed files (default: the first of "
        f"{', '.join(FLAVOURS)} that is installed)",
    )
    parser.add_argument("--check", action="store_true", help="smoke-test the slim wheels here")
    parser.add_argument(
        "--clean", action="store_true", help="remove older nixl*.whl files from out_dir first"
    )
    args = parser.parse_args(argv)

    if args.wheel:
        sources = [from_wheel(path) for path in args.wheel]
    else:
        flavours = [args.flavour] if args.flavour else list(FLAVOURS)
        sources = [from_installed("nixl")]
        for name in flavours:
            try:
                sources.append(from_installed(name.replace("_", "-")))
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            raise SystemExit(f"none of {flavours} is installed")
    flavour = next((s.name for s in sources if s.name in FLAVOURS), None)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.clean:
        for old in args.out_dir.glob("nixl*.whl"):
            old.unlink()
    rows, wheels = [], []
    for source in sources:
        if source.name in FLAVOURS:
            keep, missing = keep_flavour(source)
        elif source.name == "nixl":
            keep, missing = keep_meta(source), []
        else:
            raise SystemExit(f"not a NIXL distribution: {source.name}")
        keep = {p for p in keep if ".dist-info/" not in p}
        wheel = write_wheel(source, keep, args.out_dir, flavour)
        wheels.append(wheel)
        kept_bytes = sum(len(source.read(p)) for p in keep)
        plugins = sorted(
            p.rsplit("/", 1)[-1] for p in source.files if "libplugin_" in p and p not in keep
        )
        before = sum(".dist-info/" not in p for p in source.files)
        rows.append((source, wheel, f"{len(keep)} / {before}", kept_bytes))
        print(f"{source.name} {source.version} from {source.origin}")
        if plugins:
            print(f"  dropped plugins: {', '.join(sorted(set(plugins)))}")
        if missing:
            print(f"  outside the wheel (system or CUDA libraries): {', '.join(missing)}")
    print()
    print("| distribution | before | slim (unpacked) | slim .whl | files kept / before (*) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    total_before = total_after = 0
    for source, wheel, count, kept_bytes in rows:
        kind = "input .whl" if source.origin.endswith(".whl") else "installed"
        size = wheel.stat().st_size
        total_before += source.origin_bytes
        total_after += size
        print(
            f"| {wheel.name} | {_mib(source.origin_bytes)} ({kind}) | {_mib(kept_bytes)} | "
            f"{_mib(size)} | {count} |"
        )
    print("(*) without the dist-info, which is written anew")
    print(
        f"\ntotal: {_mib(total_before)} before -> {_mib(total_after)} of wheels in {args.out_dir}"
    )
    if args.check and not check(wheels):
        print("--check FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
