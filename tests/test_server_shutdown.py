"""`rlt serve` as a real process: SIGTERM/SIGINT end it cleanly (exit code 0) with in-flight
requests finished or aborted; without a model and without the bundled model it exits 2 with a
clear message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rlt.cli import main
from serving_harness import sse_events


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(checkpoint, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "rlt.cli",
        "serve",
        str(checkpoint),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "512",
        "--shutdown-timeout",
        "1",
        "--served-model-name",
        "tiny",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RLT_API_KEY", None)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )


def wait_ready(process: subprocess.Popen, base_url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, trust_env=False, timeout=2) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"server exited early:\n{process.stdout.read()}")
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    process.kill()
    raise AssertionError("server did not become ready")


def run_signal_test(checkpoint, signum: int) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start_server(checkpoint, port)
    try:
        wait_ready(process, base_url)
        in_flight: dict = {}
        first_chunk = threading.Event()

        def stream_long_request() -> None:
            body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
            lines = []
            try:
                with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as http:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            lines.append(line)
                            first_chunk.set()
            except httpx.TransportError as exc:
                in_flight["transport_error"] = exc
            in_flight["events"] = sse_events(lines)
            first_chunk.set()

        client = threading.Thread(target=stream_long_request)
        client.start()
        assert first_chunk.wait(60)
        process.send_signal(signum)
        assert process.wait(timeout=60) == 0
        client.join(timeout=30)
        assert not client.is_alive()
        output = process.stdout.read()
        assert "Application shutdown complete" in output, output
        # The in-flight stream outlived the 1 s grace period: it was aborted, and still ended
        # properly (last chunk with finish_reason "abort", then [DONE]).
        assert "transport_error" not in in_flight, in_flight
        events = in_flight["events"]
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base_url}/health", trust_env=False, timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_shuts_down_cleanly_with_exit_code_0(tiny_checkpoint):
    run_signal_test(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3), signal.SIGTERM)


@pytest.mark.slow
def test_sigint_shuts_down_cleanly_with_exit_code_0(tiny_checkpoint):
    run_signal_test(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3), signal.SIGINT)


def test_serve_without_a_model_explains_and_exits_2(monkeypatch, tmp_path, capsys):
    import rlt.engine.assembly as assembly

    monkeypatch.setattr(assembly, "DEFAULT_MODEL_DIR", tmp_path / "no-default-model")
    assert main(["serve"]) == 2
    error = capsys.readouterr().err
    assert "bundled default model is missing" in error and "rlt serve MODEL_DIR" in error
