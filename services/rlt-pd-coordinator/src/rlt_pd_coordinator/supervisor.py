"""Local engine instances as child processes: start, watch, restart, stop (README.md,
"Supervision", says what a child runs and what each failure does).

Each child runs in its own session (a terminal's Ctrl-C reaches only the coordinator, which
then stops the children in order) and, on Linux, gets SIGTERM if the coordinator dies
(PR_SET_PDEATHSIG). The instances' API key reaches them through $RLT_API_KEY (never on a
command line). Their output is copied to the coordinator's stderr, each line prefixed with the
instance's name; the last lines are kept for error messages. A child that exits while the
coordinator runs is marked dead at once and started again after a backoff (`restart_delay`,
doubling up to 30 s, back to the start after a minute of good health). Stop: SIGTERM to every
child, SIGKILL to those still running after `stop_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

import httpx
from rlt_contracts import RltError

from rlt_pd_coordinator.cluster import Cluster, Instance
from rlt_pd_coordinator.wire import HEALTH_PATH

logger = logging.getLogger("rlt_pd_coordinator")

DEFAULT_COMMAND = (sys.executable, "-m", "rlt.cli", "serve")
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_RESET_S = 60.0  # a child healthy this long restarts with the initial backoff again
TAIL_LINES = 40


class StartupError(RltError):
    """A local instance did not come up (exited or never became healthy)."""


@dataclass(frozen=True)
class SupervisorOptions:
    model: str  # checkpoint directory handed to every child
    command: tuple[str, ...] = DEFAULT_COMMAND
    engine_args: tuple[str, ...] = ()  # passed to every child verbatim
    devices: tuple[str, ...] = ()  # --device per child, round-robin (empty: the engine default)
    api_key: str | None = None  # the children's API key ($RLT_API_KEY)
    log_level: str = "warning"  # the children's --log-level
    startup_timeout: float = 600.0
    stop_timeout: float = 15.0
    restart_delay: float = BACKOFF_INITIAL_S  # first restart backoff (doubles up to 30 s)
    output: TextIO | None = None  # where the children's output goes (default: sys.stderr)


@dataclass(eq=False)
class Child:
    instance: Instance
    device: str | None
    port: int
    process: asyncio.subprocess.Process | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: asyncio.Task | None = None
    started_at: float = 0.0

    @property
    def name(self) -> str:
        return self.instance.name

    def exit_text(self) -> str:
        code = self.process.returncode if self.process else None
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def tail_text(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


class Supervisor:
    """Runs the local instances of `cluster` (those with `local=True`)."""

    def __init__(self, cluster: Cluster, options: SupervisorOptions) -> None:
        self.cluster = cluster
        self.options = options
        local = [i for i in cluster.instances if i.local]
        devices = options.devices
        self.children = [
            Child(i, devices[n % len(devices)] if devices else None, free_port())
            for n, i in enumerate(local)
        ]
        self._monitors: list[asyncio.Task] = []
        self._stopping = False
        self._output = options.output

    # -- startup ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every child and wait until each answers /health (not yet admitted)."""
        if not self.children:
            return
        await asyncio.gather(*(self._spawn(c) for c in self.children))
        results = await asyncio.gather(
            *(self._wait_healthy(c, self.options.startup_timeout) for c in self.children),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for failure in failures:
                if not isinstance(failure, StartupError):
                    raise failure
            raise StartupError("\n".join(str(f) for f in failures))

    def watch(self) -> None:
        """From now on, restart a child that exits (call once the cluster admitted them)."""
        for child in self.children:
            self._monitors.append(
                asyncio.create_task(self._monitor(child), name=f"rlt-pd-watch-{child.name}")
            )

    def argv(self, child: Child) -> list[str]:
        role = child.instance.role
        args = [
            *self.options.command,
            self.options.model,
            "--pd-role",
            str(role),
            "--host",
            "127.0.0.1",
            "--port",
            str(child.port),
            "--log-level",
            self.options.log_level,
            *self.options.engine_args,
        ]
        if child.device is not None:
            args += ["--device", child.device]
        return args

    async def _spawn(self, child: Child) -> None:
        env = dict(os.environ)
        env.pop("RLT_API_KEY", None)
        if self.options.api_key:
            env["RLT_API_KEY"] = self.options.api_key
        env.setdefault("PYTHONUNBUFFERED", "1")
        argv = self.argv(child)
        child.instance.url = f"http://127.0.0.1:{child.port}"
        try:
            child.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        except OSError as exc:
            raise StartupError(f"cannot start {child.name} ({' '.join(argv)}): {exc}") from None
        child.started_at = time.monotonic()
        child.instance.pid = child.process.pid
        child.tail.clear()
        child.reader = asyncio.create_task(self._copy_output(child))
        logger.info(
            "started %s (pid %d) on %s: %s",
            child.name,
            child.process.pid,
            child.instance.url,
            " ".join(argv),
        )

    async def _copy_output(self, child: Child) -> None:
        stream = child.process.stdout
        out = self._output or sys.stderr
        while True:
            raw = await stream.readline()
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            child.tail.append(line)
            with contextlib.suppress(Exception):
                out.write(f"[{child.name}] {line}\n")
                out.flush()

    async def _wait_healthy(self, child: Child, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = child.instance.url + HEALTH_PATH
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
            while True:
                if child.process.returncode is not None:
                    if child.reader is not None:  # let the last output lines arrive
                        await asyncio.wait({child.reader}, timeout=1.0)
                    raise StartupError(
                        f"{child.name} {child.exit_text()} before it was ready "
                        f"({' '.join(self.argv(child))}); its last output:\n{child.tail_text()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"{child.name} did not answer {HEALTH_PATH} within {timeout:g} s; "
                        f"its last output:\n{child.tail_text()}"
                    )
                await asyncio.sleep(0.1)

    # -- restarts -----------------------------------------------------------------------------
    async def _monitor(self, child: Child) -> None:
        initial = self.options.restart_delay
        backoff = initial
        while not self._stopping:
            await child.process.wait()
            if self._stopping:
                return
            if child.reader is not None:
                await asyncio.wait({child.reader}, timeout=1.0)
            if time.monotonic() - child.started_at > HEALTHY_RESET_S:
                backoff = initial
            reason = f"{child.exit_text()}; restarting in {backoff:g} s"
            logger.error("%s %s; its last output:\n%s", child.instance, reason, child.tail_text())
            self.cluster.mark_dead(child.instance, reason)
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, initial), BACKOFF_MAX_S)
            if self._stopping:
                return
            await self._restart(child)

    async def _restart(self, child: Child) -> None:
        """Start the child again; once healthy, admit it (it stays out on failure and is
        restarted again when its process exits, or killed and restarted if it runs on)."""
        child.instance.restarts += 1
        self.cluster.mark_starting(child.instance, f"restart {child.instance.restarts}")
        try:
            await self._spawn(child)
            await self._wait_healthy(child, self.options.startup_timeout)
            await self.cluster.admit(child.instance)
        except Exception as exc:  # noqa: BLE001 - logged; the monitor tries again
            if self._stopping:
                return
            logger.error("%s did not come back: %s", child.instance, exc)
            if isinstance(exc, StartupError):
                child.port = free_port()  # in case its port was taken meanwhile
            self._kill(child)

    # -- stop ---------------------------------------------------------------------------------
    def stop_watching(self) -> None:
        """No more restarts (the coordinator is shutting down)."""
        self._stopping = True

    async def stop(self) -> None:
        """SIGTERM every child, SIGKILL those still running after `stop_timeout`."""
        self._stopping = True
        for task in self._monitors:
            task.cancel()
        await asyncio.gather(*self._monitors, return_exceptions=True)
        running = [c for c in self.children if c.process and c.process.returncode is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
        if running:
            done, pending = await asyncio.wait(
                [asyncio.create_task(c.process.wait()) for c in running],
                timeout=self.options.stop_timeout,
            )
            if pending:
                for child in running:
                    if child.process.returncode is None:
                        logger.warning("%s did not stop in time: killing it", child.instance)
                        self._kill(child)
                await asyncio.wait(pending, timeout=5.0)
        readers = [c.reader for c in self.children if c.reader is not None]
        if readers:
            await asyncio.wait(readers, timeout=2.0)
        for child in self.children:
            if child.process is not None:
                logger.info("%s %s", child.instance, child.exit_text())

    def kill_all(self) -> None:
        """Immediate SIGKILL (a second Ctrl-C while stopping)."""
        for child in self.children:
            self._kill(child)

    @staticmethod
    def _kill(child: Child) -> None:
        if child.process is not None and child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()


def free_port() -> int:
    """A TCP port the OS considers free now (the child binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- PR_SET_PDEATHSIG: children get SIGTERM when the coordinator dies (Linux) -----------------
_PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
