"""`rlt ray ...` run as a user runs it: the installed console script under `uv run` (the
README's launcher; `.venv/bin/rlt` when uv is not on PATH), in a process group of its own so
that a test can send SIGINT to the whole group, as a terminal's Ctrl-C does (uv then forwards
its own copy of the signal: the command sees two)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
READY = re.compile(r"rlt ray: ready at (\S+)")
PRIVATE = re.compile(r"rlt ray: started a private Ray cluster at (\S+) \(logs: (\S+)\)")


def launcher() -> list[str]:
    uv = shutil.which("uv")
    if uv is not None:  # --no-sync: never rebuild the environment the suite runs in
        return [uv, "run", "--no-sync", "rlt"]
    return [str(Path(sys.executable).parent / "rlt")]


class Command:
    """One `rlt ray ...` process; its output (stdout and stderr) is collected on a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = [*launcher(), "ray", *argv]
        self.process = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own session and process group (id: its pid)
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_line(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        """The first output line matching `pattern`; fails (with the output) if the command
        exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines:
                    if match := pattern.search(line):
                        return match
                left = deadline - time.monotonic()
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"exited {self.process.returncode}:\n{self.output}")
                if left <= 0:
                    raise AssertionError(
                        f"no {pattern.pattern!r} in {timeout_s:g} s:\n{self.output}"
                    )
                self._changed.wait(min(left, 1.0))

    def interrupt_group(self) -> None:
        """SIGINT to the command's whole process group (a terminal's Ctrl-C)."""
        os.killpg(self.process.pid, signal.SIGINT)

    def wait(self, timeout_s: float) -> int:
        code = self.process.wait(timeout_s)
        self._reader.join(10)
        return code

    def group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """Cleanup after a failed test: the whole group, then whatever its session left."""
        if self.group_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(30)


def processes() -> dict[int, tuple[int, str]]:
    """{pid: (session id, command line)} of this machine's processes."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            found[int(entry)] = (os.getsid(int(entry)), command)
        except OSError:
            continue
    return found


def private_session(temp_dir: str) -> int:
    """The session of the private cluster whose `ray start` runs with `temp_dir`."""
    [sid] = {sid for sid, command in processes().values() if f"--temp-dir={temp_dir}" in command}
    return sid


def session_processes(sid: int) -> dict[int, str]:
    return {pid: command for pid, (s, command) in processes().items() if s == sid}


def kill_session(sid: int) -> None:
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def command_env(**extra: str) -> dict[str, str]:
    """The test process's environment without RAY_ADDRESS, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra)
    return env


def completion(url: str, max_tokens: int, *, stream: bool = False, **extra) -> dict:
    return {
        "model": "default_model",
        "prompt": "It is a truth universally acknowledged",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


def post_plain(url: str, max_tokens: int, **extra) -> httpx.Response:
    body = completion(url, max_tokens, **extra)
    return httpx.post(f"{url}/v1/completions", json=body, timeout=180, trust_env=False)


def choice_text(events: list) -> str:
    return "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )
