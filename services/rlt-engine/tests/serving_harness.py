"""Run the real HTTP server (uvicorn on 127.0.0.1, a free port) in a background thread.

The listening socket is bound before uvicorn starts (port 0, so the OS picks a free port) and
handed to it, so there is no window in which another process could take the port.

Also the fixtures a test module with its own `server` fixture (a `run_server(...)`,
module-scoped) gets through its conftest: a checkpoint and clients of that server. Clients use
httpx2, the HTTP client rlt declares (the `openai` client's own); the root tests import this
module too (the workspace's pytest `pythonpath`).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import openai
import pytest
import uvicorn
from msgspec.structs import replace
from rlt.engine import EngineConfig, LLMEngine
from rlt.serving.async_engine import AsyncEngine
from rlt.serving.front_end import uvicorn_config
from rlt.serving.server import ServeOptions, build_server

ENGINE_DEFAULTS = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=512,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    prefill_chunk_size=16,
)


@dataclass
class RunningServer:
    base_url: str
    port: int
    engine: LLMEngine
    client: AsyncEngine
    app: Any
    options: ServeOptions

    def http(self, **kwargs) -> httpx2.Client:
        return httpx2.Client(base_url=self.base_url, trust_env=False, timeout=30, **kwargs)

    def openai(self, **http_kwargs) -> openai.OpenAI:
        """The official client against this server (no retries, no proxy from the
        environment); http_kwargs go to its httpx2.Client (e.g. timeout, event_hooks)."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx2.Client(trust_env=False, **http_kwargs),
        )

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Poll engine stats until no request runs or waits and no KV block is used."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.client.stats()
            if (
                stats.kv_blocks_used == 0
                and stats.running_requests == 0
                and stats.waiting_requests == 0
            ):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.02)


@contextlib.contextmanager
def run_server(
    model_dir, *, check_leaks: bool = True, engine=None, **options
) -> Iterator[RunningServer]:
    """Serve `model_dir` (engine options: ENGINE_DEFAULTS updated by `engine`; HTTP options:
    ServeOptions fields) until the block ends; then shut down and check for KV leaks."""
    config = EngineConfig.from_options(model=model_dir, **{**ENGINE_DEFAULTS, **(engine or {})})
    llm_engine = LLMEngine(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    serve_options = replace(
        ServeOptions(log_level="warning", shutdown_timeout=2.0), port=port, **options
    )
    app, client = build_server(llm_engine, serve_options)
    server = uvicorn.Server(uvicorn_config(app, serve_options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    running = RunningServer(
        f"http://127.0.0.1:{port}", port, llm_engine, client, app, serve_options
    )
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        client.close(timeout=30)
        sock.close()
    try:
        assert not thread.is_alive(), "uvicorn did not stop"
        if check_leaks:
            assert_engine_clean(llm_engine)
    finally:
        # the engine's owner releases it: its KV pool and, for a PD role, its NIXL agent,
        # whose UCX progress thread polls without pause while the agent lives
        if client.stopped:
            llm_engine.shutdown()


def assert_engine_clean(engine: LLMEngine) -> None:
    """After shutdown: nothing unfinished and no resource held (EngineCore.leak_report)."""
    assert engine.core.leak_report() == []


def sse_events(lines) -> list[dict | str]:
    """Parse `data:` lines of an SSE body into JSON objects; the final "[DONE]" stays a str."""
    import json

    events: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)(?: -?\d+)?")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample of a Prometheus text exposition (`/metrics`), in
    order; a line that is neither a sample, a comment nor blank fails the test."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample = _SAMPLE.fullmatch(line)
        assert sample is not None, f"not a Prometheus sample: {line!r}"
        name, written, value = sample.groups()
        labels, position = {}, 0
        while position < len(written or ""):
            label = _LABEL.match(written, position)
            assert label is not None, f"not Prometheus labels: {line!r}"
            labels[label[1]] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], label[2])
            position = label.end()
        samples.append((name, labels, float(value)))
    return samples


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVE_FLAGS = ("--dtype", "float32", "--device", "cpu", "--block-size", "4")


def start_serve_process(
    checkpoint, port: int, *flags: str, shutdown_timeout: float = 1, num_kv_blocks: int = 512
) -> subprocess.Popen:
    """`rlt serve` as a real process (its engine core is a child of it), output in `stdout`."""
    command = [sys.executable, "-m", "rlt.cli", "serve", str(checkpoint), "--port", str(port)]
    command += [*SERVE_FLAGS, "--num-kv-blocks", str(num_kv_blocks)]
    command += ["--shutdown-timeout", str(shutdown_timeout), "--served-model-name", "tiny", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RLT_API_KEY", None)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )


def wait_ready(process: subprocess.Popen, base_url: str, timeout: float = 120) -> None:
    """Until /health answers 200 (raises with the server's output if it exited)."""
    deadline = time.monotonic() + timeout
    with httpx2.Client(base_url=base_url, trust_env=False, timeout=2) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"server exited early:\n{process.stdout.read()}")
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.1)
    process.kill()
    raise AssertionError("server did not become ready")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    """The tiny random Ouro most server tests serve (2 layers, 4 loops, a spread exit gate)."""
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


@pytest.fixture(scope="module")
def http(server):
    """httpx2 client of the module's server."""
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's server."""
    return server.openai()
