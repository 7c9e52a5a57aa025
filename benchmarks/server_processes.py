"""Processes of a benchmarked server, read from /proc (Linux): a free port to start it on,
the tree of processes it started, and each one's CPU seconds (served_vs_offline.py,
ray_vs_serve.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def family(pid: int) -> list[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(stat[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                pass
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_bench_serve(
    port: int,
    server_pid: int,
    *,
    input_len: int,
    output_len: int,
    count: int,
    seed: int,
    concurrency: int | None,
) -> tuple[dict, dict[int, float]]:
    """One `rlt bench serve` run against the server on `port` (random prompts of `input_len`
    tokens, `output_len` generated, ignore_eos; at most `concurrency` in flight): its result
    JSON, and the CPU seconds each process of the server's tree spent meanwhile (processes
    that came or went in between left out)."""
    import json
    import subprocess
    import sys
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    command = [sys.executable, "-m", "rlt.cli", "bench", "serve", "--port", str(port)]
    command += ["--model", "bench", "--dataset-name", "random", "--metric-percentiles", "50,99"]
    command += ["--random-input-len", str(input_len)]
    command += ["--random-output-len", str(output_len), "--random-range-ratio", "0"]
    command += ["--ignore-eos", "--disable-tqdm", "--num-prompts", str(count)]
    command += ["--save-result", "--result-dir", str(out), "--result-filename", "r.json"]
    command += ["--seed", str(seed)]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    pids = family(server_pid)
    before = {p: cpu_seconds(p) for p in pids}
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = {p: cpu_seconds(p) for p in pids}
    cpu = {p: after[p] - before[p] for p in pids if None not in (before[p], after[p])}
    return json.loads((out / "r.json").read_text()), cpu
