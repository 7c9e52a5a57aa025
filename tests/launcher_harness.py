"""Server commands started as a user starts them: `uv run rlt ...` (the README's launcher), in
a process group of their own, as a terminal, systemd or a supervisor runs them.

`Launch` keeps the output (a thread reads it), finds the rlt process under uv, tells when it
has its stop-signal policy installed (SIGTERM caught: Python never catches it by default), and
after the exit finds any process the command left: each launch puts a unique mark in its
environment, which every descendant inherits, also those that left the process group (the
front ends of `--api-server-count N`, PD instances in their own sessions).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serving_harness import sse_events

REPO = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")
MARK_VARIABLE = "RLT_TEST_LAUNCH_MARK"


class OutputReader:
    """Collects a process's output lines on a thread; `wait_for` blocks until a line holds a
    text (or the output ends)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> bool:
        with self._changed:
            self._changed.wait_for(lambda: self.has(text) or self._ended, timeout)
            return self.has(text)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


class Launch:
    """`uv run --no-sync --offline <args>` from the repository root, in a new session."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.mark = uuid.uuid4().hex
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env[MARK_VARIABLE] = self.mark
        env.pop("RLT_API_KEY", None)
        self.process = subprocess.Popen(
            [UV, "run", "--no-sync", "--offline", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.process.pid
        self.output = OutputReader(self.process)
        self.base_url = f"http://127.0.0.1:{port}" if port is not None else None

    # -- start-up -----------------------------------------------------------------------------
    def rlt_pid(self) -> int | None:
        """The command's own process (uv's child), once it runs."""
        children = _children(self.process.pid)
        return children[0] if children else None

    def wait_policy_installed(self, timeout: float = 120) -> int:
        """Until the rlt process catches SIGTERM (its stop-signal policy is installed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.rlt_pid()
            if pid is not None and _catches(pid, signal.SIGTERM):
                return pid
            assert self.process.poll() is None, f"exited early:\n{self.output.text()}"
            time.sleep(0.005)
        raise AssertionError(f"no stop-signal policy within {timeout} s:\n{self.output.text()}")

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, trust_env=False, timeout=2) as http:
            while time.monotonic() < deadline:
                assert self.process.poll() is None, f"exited early:\n{self.output.text()}"
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/health").status_code == 200:
                        return
                time.sleep(0.05)
        raise AssertionError(f"not healthy within {timeout} s:\n{self.output.text()}")

    # -- stop ---------------------------------------------------------------------------------
    def signal_group(self, signum: int) -> float:
        """Send `signum` to the whole process group (a terminal's Ctrl-C, systemd, `kill --
        -PGID`); returns when."""
        sent = time.monotonic()
        os.killpg(self.pgid, signum)
        return sent

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {timeout:g} s after the signal:\n{self.output.text()}"
            ) from None

    def left_behind(self, timeout: float = 10) -> list[str]:
        """Processes of this launch still alive (`timeout` to let the last ones go)."""
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(set(_marked(self.mark)) | set(_in_group(self.pgid)))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def kill(self) -> None:
        """Clean-up after a failed test: everything this launch started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        for entry in _marked(self.mark):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid and stat[0] != "Z":
                    found.append(int(entry.name))
    return sorted(found)


def _in_group(pgid: int) -> list[str]:
    """'PID COMMAND' of every live process of process group `pgid` (zombies excluded: one
    whose parent exited waits for init to reap it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[2]) == pgid and stat[0] != "Z":
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{entry.name} {command.strip()}")
    return found


def _catches(pid: int, signum: int) -> bool:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
        return bool(caught & (1 << (signum - 1)))
    return False


def _marked(mark: str) -> list[str]:
    """'PID COMMAND' of every live process whose environment holds `mark`."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, not yet reaped by its parent
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            found.append(f"{entry.name} {command.strip()}")
    return found


@dataclass
class InFlight:
    """Requests on a thread each while a server stops: `long` as a plain request, then (half
    a second later, so that the plain one generated) as a stream, and `short` (if given) as a
    plain request; `start` returns once the stream brought text. The long ones outlive the
    drain; the short one ends within it."""

    base_url: str
    long: dict
    short: dict | None = None
    results: dict = field(default_factory=dict)
    streaming: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self._run("plain", self._plain, self.long)
        if self.short is not None:
            self._run("short", self._plain, self.short)
        time.sleep(0.5)
        self._run("stream", self._stream, {**self.long, "stream": True})
        assert self.streaming.wait(60), self.results

    def _run(self, name: str, target, body: dict) -> None:
        thread = threading.Thread(target=target, args=(name, body), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _plain(self, name: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=self.base_url, trust_env=False, timeout=120) as http:
                self.results[name] = http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self.results[name] = exc

    def _stream(self, name: str, body: dict) -> None:
        lines: list[str] = []
        try:
            with httpx.Client(base_url=self.base_url, trust_env=False, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        lines.append(line)
                        if _has_text(line):
                            self.streaming.set()
            self.results[name] = sse_events(lines)
        except httpx.HTTPError as exc:
            self.results[name] = exc
        self.streaming.set()

    def check_answered(self) -> None:
        """Each request answered 200 as at a drain's end: the long ones with finish_reason
        "abort" and their partial text (the stream: a last chunk, then `[DONE]`), the short
        one finished or aborted."""
        for thread in self.threads:
            thread.join(timeout=60)
            assert not thread.is_alive()
        plain = self.results["plain"]
        assert isinstance(plain, httpx.Response) and plain.status_code == 200, plain
        choice = plain.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["text"], choice
        if self.short is not None:
            short = self.results["short"]
            assert isinstance(short, httpx.Response) and short.status_code == 200, short
            assert short.json()["choices"][0]["finish_reason"] in ("length", "abort")
        events = self.results["stream"]
        assert isinstance(events, list), events
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def _has_text(line: str) -> bool:
    events = sse_events([line])
    if not events or events[0] == "[DONE]":
        return False
    choices = events[0].get("choices")
    return bool(choices) and bool(choices[0].get("text"))


def check_stopped_cleanly(
    launch: Launch, signalled_at: float, bound_s: float, expected_code: int = 0
) -> str:
    """The command exited with `expected_code` within `bound_s` of the signal, printed no
    traceback and left no process; returns its output."""
    code = launch.wait_exit(bound_s)
    took = time.monotonic() - signalled_at
    output = launch.output.text()
    assert code == expected_code, output
    assert took <= bound_s, f"{took:.1f} s:\n{output}"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "CancelledError" not in output, output
    left = launch.left_behind()
    assert not left, f"left behind: {left}\n{output}"
    return output
