"""`rlt pd serve` as a process over fake engine instances: children supervised, a prefill
instance SIGKILLed mid-transfer and restarted, Ctrl-C stopping the whole group with exit 0.

Here, not beside the coordinator: with no `--model` the coordinator loads the tokenizer of the
rlt engine's bundled model, which lives in the `rlt` distribution (a member the coordinator does
not depend on). The fake instances and helpers are the coordinator's test support.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import fake_engine
import httpx
import pytest
from test_pd_coordinator import complete, wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def instances(http) -> list[dict]:
    return http.get("/v1/pd/instances").json()["instances"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # ~12 s on 2 cores, mostly the coordinator loading the real tokenizer
def test_cli_supervises_children_restarts_a_killed_prefill_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    fake = f"{sys.executable} {fake_engine.__file__}"
    log = open(tmp_path / "coordinator.log", "w+")  # noqa: SIM115 - read after the process
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlt_pd_coordinator",
            "pd",
            "serve",
            "--num-prefill",
            "1",
            "--num-decode",
            "1",
            "--port",
            str(port),
            "--engine-command",
            fake,
            "--fake-prefill-delay",  # unknown to rlt pd serve: --engine-command's, passed on
            "0.6",
            "--restart-delay",
            "0.2",
            "--transfer-timeout",
            "20",
            "--poll-interval",
            "0.2",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as http:

            def up() -> bool:
                if process.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"the coordinator exited:\n{log.read()}")
                with contextlib.suppress(httpx.HTTPError):
                    return http.get("/health").status_code == 200
                return False

            wait_for(up, timeout=60, what="the coordinator")
            assert complete(http).json()["choices"][0]["exit_depths"] == [4, 2, 3, 1]
            prefill, decode = instances(http)
            assert prefill["role"] == "prefill" and prefill["local"] and prefill["pid"]

            # SIGKILL the prefill process mid-transfer (it takes 0.6 s to "write" the KV)
            timer = threading.Timer(0.3, os.kill, (prefill["pid"], signal.SIGKILL))
            timer.start()
            start = time.monotonic()
            response = complete(http)
            timer.join()
            assert time.monotonic() - start < 5  # well within the transfer timeout
            assert response.status_code == 503
            assert "prefill instance prefill-0" in response.json()["error"]["message"]

            # restarted (after --restart-delay), admitted again and reconnected with D
            wait_for(
                lambda: (
                    instances(http)[0]["restarts"] == 1 and instances(http)[0]["state"] == "ready"
                ),
                timeout=30,
                what="the restarted prefill instance",
            )
            new_prefill = instances(http)[0]
            assert new_prefill["pid"] != prefill["pid"]
            assert new_prefill["agent"] != prefill["agent"]
            assert complete(http).json()["choices"][0]["text"] != ""

            pids = [new_prefill["pid"], decode["pid"]]
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0
            wait_for(lambda: not any(alive(pid) for pid in pids), what="children stopped")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
