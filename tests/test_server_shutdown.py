"""`rlt serve` as a real process: SIGTERM/SIGINT end it cleanly (exit code 0) with in-flight
requests finished or aborted; a second signal during the drain aborts the rest at once, still
cleanly (JSON bodies, streams ending with a last chunk and [DONE], no tracebacks), and the exit
code says so (128 + the signal); without a model and without the bundled model it exits 2 with
a clear message."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from rlt.cli import main
from serving_harness import free_port, sse_events, start_serve_process, wait_ready


def run_signal_test(checkpoint, signum: int) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start_serve_process(checkpoint, port)
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


@pytest.mark.slow
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


class OutputReader:
    """Collects a process's output lines on a thread; `wait_for` blocks until a line holds a
    text (or the process ends)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # end of output
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: any(text in line for line in self.lines) or "" in self.lines, timeout
            ) and any(text in line for line in self.lines)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_aborts_the_drain_cleanly_and_exits_128_plus_it(tiny_checkpoint, second):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # a drain would wait long; both 500-token requests fit the KV pool at once
    process = start_serve_process(checkpoint, port, shutdown_timeout=600, num_kv_blocks=2048)
    try:
        wait_ready(process, base_url)
        output = OutputReader(process)
        results: dict = {}
        streaming = threading.Event()
        long = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True}

        def plain_request() -> None:
            with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as http:
                results["plain"] = http.post("/v1/completions", json=long)

        def stream_request() -> None:
            lines = []
            with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as http:
                body = {**long, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        lines.append(line)
                        streaming.set()
            results["events"] = sse_events(lines)
            streaming.set()

        clients = [threading.Thread(target=plain_request), threading.Thread(target=stream_request)]
        for thread in clients:
            thread.start()
        assert streaming.wait(60)
        with httpx.Client(base_url=base_url, trust_env=False, timeout=10) as http:
            deadline = time.monotonic() + 60
            while running_requests(http) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert running_requests(http) == 2
        process.send_signal(signal.SIGINT)
        assert output.wait_for("Shutting down")  # draining (it would wait 600 s)
        process.send_signal(second)
        assert process.wait(timeout=60) == 128 + second
        for thread in clients:
            thread.join(timeout=30)
            assert not thread.is_alive()
        log = output.text()
        assert "Traceback" not in log and "CancelledError" not in log, log
        plain = results["plain"]
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["finish_reason"] == "abort"
        events = results["events"]
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def running_requests(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    return float(re.search(r"^rlt:num_requests_running\{[^}]*\} (\S+)$", metrics, re.M).group(1))
