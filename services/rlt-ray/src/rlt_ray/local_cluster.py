"""`PrivateCluster`: the one-node Ray cluster that `rlt ray serve` / `rlt ray pd serve` start
when no cluster is named (no `--address`, no `RAY_ADDRESS`): `ray start --head --block` as a
child in a POSIX session of its own, with its own temporary directory (its address file too)
and free ports, so that a terminal's Ctrl-C reaches only rlt (which drains Serve before it
stops the cluster) and no other `ray.init()` joins it. `stop()` sends SIGTERM to `ray start`
and kills its session past the bound; on Linux the child also gets SIGTERM when rlt dies
(PR_SET_PDEATHSIG). README.md, "Which cluster", has the rest.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rlt_contracts import RltError

ADDRESS_FILE = "ray_current_cluster"  # what `ray start` writes into its --temp-dir
START_LOG = "ray-start.log"
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 15
PR_SET_PDEATHSIG = 1
NODE_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


class ClusterStartError(RltError, RuntimeError):
    """The Ray cluster could not be started (the message holds the tail of its log) or
    joined."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec function that makes the child receive SIGTERM when this process dies (Linux),
    resolved before the fork (nothing to look up in the child)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return set_parent_death_signal


class PrivateCluster:
    """A private one-node Ray cluster (see the module docstring): `launch()`, then
    `wait_ready()` returns its GCS address once `ray start` is up; `stop()` is idempotent and
    safe after a failed start."""

    def __init__(self, *, num_cpus: float | None = None, num_gpus: float | None = None) -> None:
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.temp_dir: Path | None = None
        self.address: str | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        """`ray start --head --block` with every port it would otherwise take by default
        (6379, 8265, 10001, 52365) chosen free, no dashboard, no autoscaler, and no idle
        workers started ahead of need (they would compete with Ray's own agents, which must
        come up within Ray's fixed 15 s, on a small machine)."""
        assert self.temp_dir is not None
        command = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--port=0",
            f"--temp-dir={self.temp_dir}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--no-monitor",
            f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--system-config={json.dumps(SYSTEM_CONFIG)}",
        ]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus:g}")
        if self.num_gpus is not None:
            command.append(f"--num-gpus={self.num_gpus:g}")
        return command

    def launch(self) -> None:
        """Start `ray start` (returns at once; `wait_ready()` waits for the cluster)."""
        root = "/tmp" if os.path.isdir("/tmp") else None  # short: Ray's socket paths must fit
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlt-ray-", dir=root))
        self._log = open(self.temp_dir / START_LOG, "w")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            self.command(),
            # rlt drains Serve before it stops the cluster: `ray start` need not wait for the
            # node to drain (by default up to 30 s) when it gets SIGTERM
            env={**os.environ, NODE_DRAIN_ENV: "0"},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        """The cluster's address, once `ray start` published it; raises ClusterStartError when
        `ray start` exits or `timeout_s` passes (then `stop(keep_logs=True)`)."""
        address_file = self.temp_dir / ADDRESS_FILE
        deadline = time.monotonic() + timeout_s
        while not address_file.exists():
            code = self._process.poll()
            if code is not None:
                raise ClusterStartError(
                    f"the private Ray cluster did not start: `ray start` exited with {code} "
                    f"(Ray's logs: {self.temp_dir}): {self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"the private Ray cluster did not start within {timeout_s:g} s (Ray's "
                    f"logs: {self.temp_dir}): {self.log_tail()}"
                )
            time.sleep(0.1)
        time.sleep(0.05)  # the file is written in one call; let it land
        self.address = address_file.read_text().strip()
        return self.address

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def log_tail(self) -> str:
        if self.temp_dir is None:
            return ""
        try:
            lines = (self.temp_dir / START_LOG).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-LOG_TAIL_LINES:] if line.strip())

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, *, keep_logs: bool = False) -> None:
        """SIGTERM to `ray start` (it stops the processes it started), its session SIGKILLed
        after `timeout_s`; the temporary directory is removed unless `keep_logs`."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.kill_session(process.pid)
                    process.wait(10)
            self.kill_session(process.pid)  # anything of its session still there
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.temp_dir is not None and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def kill_now(self) -> None:
        """SIGKILL the whole session at once (a forced exit)."""
        if self._process is not None:
            self.kill_session(self._process.pid)

    @staticmethod
    def kill_session(leader: int) -> None:
        """SIGKILL every process of the session `leader` started (its own id)."""
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
            if not entry.isdigit():
                continue
            try:
                if os.getsid(int(entry)) == leader:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue
