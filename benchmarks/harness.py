"""What every benchmark shares: its command line's common options, timing, the JSON record it
writes (benchmark, time, commit, command, device description), child processes and plots.

A record is `record(name, args, **body)`: the body next to what makes a number comparable with
another (the code's commit: $RLT_COMMIT, else `git rev-parse HEAD` of this checkout; the
command line; host, Python, torch and Triton versions and the GPUs). `write_json` writes it (a
path of None writes nothing), so a program that saves after every measurement keeps what it
measured when it is cut short. Where the members are not installed (the device machine runs
the sources), importing this module puts every member's src/ on sys.path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [str(p) for top in ("packages", "services") for p in sorted(ROOT.glob(f"{top}/*/src"))]
if importlib.util.find_spec("rlt_contracts") is None:  # not installed: run the sources
    sys.path[:0] = SOURCES
# NVLink multicast stays off on the device machines (tools/h200_run.sh sets the same)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
NO_MULTICAST["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


# -- command line --------------------------------------------------------------------------------
def parser(doc: str, *, device: str | None = None, dtype: str | None = None, out: bool = True):
    """A parser whose help is the program's docstring, with --device / --dtype (when given a
    default) and --out (the JSON record)."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if device is not None:
        p.add_argument("--device", default=device)
    if dtype is not None:
        p.add_argument("--dtype", default=dtype)
    if out:
        p.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    return p


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


# -- the record ----------------------------------------------------------------------------------
def commit() -> str | None:
    if os.environ.get("RLT_COMMIT"):
        return os.environ["RLT_COMMIT"]
    command = ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_description(device: str = "cpu") -> dict:
    """Host, versions and GPUs (CUDA details only when torch is already imported)."""
    described = {"device": device, "host": socket.gethostname(), "cpus": os.cpu_count()}
    described |= {"platform": platform.platform(), "python": platform.python_version()}
    described |= {"torch": version("torch"), "triton": version("triton"), "device_name": "cpu"}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        described |= {"cuda": torch.version.cuda, "gpus": gpus}
        described["device_name"] = gpus[0] if device.startswith("cuda") else "cpu"
    return described


def record(benchmark: str, args: argparse.Namespace | dict | None = None, **body) -> dict:
    options = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return {
        "benchmark": benchmark,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": device_description(str(options.get("device") or "cpu")),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
        **body,
    }


def write_json(path: str | Path | None, payload) -> None:
    if path is None:
        return
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# -- devices and timing --------------------------------------------------------------------------
def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


class Timer:
    """Median time (ms) of a callable: CUDA graph replays timed with events on CUDA, wall-clock
    time of eager calls on the CPU."""

    def __init__(self, device: str, replays: int, warmup: int) -> None:
        self.cuda = str(device).startswith("cuda")
        self.replays, self.warmup = replays, warmup

    def capture(self, fn):
        """CUDA: (graph.replay, outputs of the captured call). CPU: (fn, None)."""
        if not self.cuda:
            return fn, None
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels, settle the allocator
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph._keep_alive = out  # the outputs live in the graph pool
        return graph.replay, out

    def median_ms(self, run) -> float:
        for _ in range(self.warmup):
            run()
        if not self.cuda:
            times = []
            for _ in range(self.replays):
                start = time.perf_counter()
                run()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        import torch

        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.replays)
        ]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


# -- child processes -----------------------------------------------------------------------------
def child_env(**extra: str) -> dict:
    """This environment with every member's src/ on PYTHONPATH (the device machine runs the
    sources), unbuffered output and NVLink multicast off."""
    env = dict(os.environ)
    paths = SOURCES + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(NO_MULTICAST, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", **extra)
    return env


def run_logged(cmd: list[str], log: Path, timeout_s: float, echo: str | None = None):
    """Run `cmd` from the repository root with `child_env()`, its output into `log` (and echoed
    with the prefix `echo`, if given); -> ("ok" | "failed (exit N)" | "timeout", seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

        def pump():
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                out.write(line)
                if echo is not None and "USDT:" not in line:  # profiler chatter
                    print(f"  [{echo}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        reader.join(5)
    status = "timeout" if rc is None else "ok" if rc == 0 else f"failed (exit {rc})"
    return status, round(time.perf_counter() - start, 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- plots ---------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
