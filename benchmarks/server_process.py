"""One server process of a benchmark: started on a free port in a session of its own, waited
for until /health answers, measured with `rlt bench serve`, stopped with SIGINT (what Ctrl-C
sends; then whatever of its process tree is left is killed), and the CPU seconds its process
tree spent during a measurement, read from /proc (Linux)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import child_env, free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


class Server:
    """`command` (a serving command line without --port) on a free port."""

    def __init__(self, command: list[str], log_path: Path, *, env=None, timeout_s=900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*command, "--port", str(self.port)]
        self.log_path = Path(log_path)
        self.log = self.log_path.open("w")
        start = time.perf_counter()
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            start_new_session=True,
        )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}:\n{self.tail()}")
            if time.perf_counter() - start > timeout_s:
                self.stop()
                raise RuntimeError(f"not healthy within {timeout_s:g} s:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        self.startup_s = time.perf_counter() - start

    def tail(self, lines: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_lines(self, *needles: str) -> list[str]:
        text = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in text if any(needle in line for needle in needles)]

    def bench(self, *, input_len, output_len, count, seed, concurrency=None, rate=None):
        """One `rlt bench serve` run (random prompts of `input_len` tokens, `output_len`
        generated, ignore_eos; at most `concurrency` in flight, or Poisson arrivals at `rate`
        requests/s): its result JSON, and the CPU seconds of each process of the server's
        tree meanwhile (processes that came or went in between left out)."""
        out = Path(tempfile.mkdtemp(prefix="bench-serve-"))
        command = [sys.executable, "-m", "rlt.cli", "bench", "serve", "--base-url", self.url]
        command += ["--model", "bench", "--dataset-name", "random", "--metric-percentiles"]
        command += ["50,99", "--random-input-len", str(input_len), "--random-output-len"]
        command += [str(output_len), "--random-range-ratio", "0", "--ignore-eos"]
        command += ["--disable-tqdm", "--num-prompts", str(count), "--seed", str(seed)]
        command += ["--save-result", "--result-dir", str(out), "--result-filename", "r.json"]
        if concurrency is not None:
            command += ["--max-concurrency", str(concurrency)]
        if rate is not None:
            command += ["--request-rate", str(rate)]
        pids = family(self.process.pid)
        before = {p: cpu_seconds(p) for p in pids}
        done = subprocess.run(command, capture_output=True, text=True, env=child_env())
        if done.returncode != 0:
            raise RuntimeError(
                f"rlt bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}"
            )
        after = {p: cpu_seconds(p) for p in pids}
        cpu = {p: after[p] - before[p] for p in pids if None not in (before[p], after[p])}
        return json.loads((out / "r.json").read_text()), cpu

    def stop(self, timeout_s: float = 60.0) -> int | None:
        pids = family(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"no exit {timeout_s:g} s after SIGINT: killing its group", flush=True)
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for pid in pids[1:]:  # only processes this server started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        return self.process.returncode
