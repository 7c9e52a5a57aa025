"""`rlt serve` with its engine core in its own process (real processes, CPU, fp32).

Checked: the served outputs equal the in-process engine's (tokens, exit depths, logprobs, text)
for completions and chat, streaming and not, `n > 1`, stop strings; and every failure across
the process boundary: the core killed while a streaming completion, a streaming chat with
n = 2 and a non-streaming request run (each stream ends with its choices' last chunks, the
usage chunk, the 503 error event and [DONE]; the plain request answers 503; /health fails;
the server exits non-zero within seconds), the front end killed (the core exits on its own),
one of two API servers killed (its requests are aborted in the core, their KV freed, a new API
server takes its place), the core killed under two API servers (the same endings; they all
exit, code 1), the supervisor killed. No process of the group is left behind in any case.
Two API servers' /metrics: every scrape, whichever answers it, shows the requests both
answered and the same engine counters; a killed one's counts stay in the totals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from in_flight_failures import RequestsInFlight
from rlt import LLM, SamplingParams
from serving_harness import free_port, sse_events, start_serve_process, wait_ready

pytestmark = pytest.mark.slow  # each test starts `rlt serve` processes

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16]]
EXIT_WAIT_S = 15  # "within seconds": generous for a loaded 2-core CI machine


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


def wait_gone(pids, timeout: float = EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


class Server:
    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process, self.port = process, port
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx2.Client(base_url=self.url, trust_env=False, timeout=60)

    def core_pid(self) -> int:
        """The engine core: the server's child that is neither multiprocessing's resource
        tracker nor an API server (those hold the listening socket)."""
        [core] = [
            p
            for p in descendants(self.process.pid)
            if _parent(p) == self.process.pid
            and b"resource_tracker" not in _cmd(p)
            and not tcp_sockets(p, LISTEN)
        ]
        return core

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        return float(next(x for x in text.splitlines() if x.startswith(name)).rsplit(" ", 1)[1])

    def running(self) -> int:
        return int(self.metric("rlt:num_requests_running"))

    def wait_running(self, count: int) -> None:
        """Until `count` requests run in the core (read from any front end's /metrics)."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while (running := self.running()) != count:
            assert time.monotonic() < deadline, running
            time.sleep(0.02)


def _cmd(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return -1


LISTEN, ESTABLISHED = "0A", "01"


def tcp_sockets(pid: int, state: str, port: int | None = None) -> int:
    """How many TCP sockets in `state` (on local `port`, if given) the process holds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    count = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == state and fields[9] in inodes and port in (None, local_port):
                count += 1
    return count


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """The tiny shape with an 8K context, so a stream outlives the kills below."""
    from rlt_models import OuroConfig, RandomInit, write_random_checkpoint

    config = OuroConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        total_ut_steps=4,
        max_position_embeddings=8192,
    )
    out = tmp_path_factory.mktemp("long_ctx")
    return write_random_checkpoint(out, config, seed=3, init=RandomInit(gate_std=0.3))


@contextlib.contextmanager
def serve(checkpoint, *flags: str) -> Iterator[Server]:
    port = free_port()
    process = start_serve_process(checkpoint, port, *flags, num_kv_blocks=8192)
    server = Server(process, port)
    group = set()
    try:
        wait_ready(process, server.url)
        group = descendants(process.pid)
        yield server
    finally:
        group |= descendants(process.pid)
        if process.poll() is None:
            process.kill()
        process.wait()
        for pid in group:  # a test failure must not leave processes for the next test
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        server.http.close()


def start_stream(server: Server, results: dict, **body) -> threading.Thread:
    """Stream a long completion on a thread; results["events"] (SSE) or ["status"]."""
    started = threading.Event()

    def run() -> None:
        payload = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines = []
        try:
            with httpx2.Client(base_url=server.url, trust_env=False, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json={**payload, **body}) as response:
                    results["status"] = response.status_code
                    for line in response.iter_lines():
                        lines.append(line)
                        started.set()
        except httpx2.TransportError as exc:
            results["transport_error"] = exc
        results["events"] = sse_events(lines)
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)
    return thread


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", block_size=4, num_kv_blocks=512)


def test_served_outputs_equal_the_in_process_engine(checkpoint, reference):
    params = SamplingParams(max_tokens=8, exit_threshold=0.8, logprobs=2, temperature=0.0)
    expected = reference.generate(PROMPTS, params)
    sampled = [  # sequence j of a seeded request samples with seed + j (vLLM's rule)
        SamplingParams(max_tokens=6, temperature=0.9, seed=11 + j, exit_threshold=0.7)
        for j in range(2)
    ]
    with serve(checkpoint) as server:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            body = dict(prompt=prompt, max_tokens=8, exit_threshold=0.8, logprobs=2)
            body.update(temperature=0.0, return_token_ids=True)
            [choice] = server.http.post("/v1/completions", json=body).json()["choices"]
            assert choice["token_ids"] == want.token_ids
            assert choice["exit_depths"] == want.exit_depths
            assert choice["text"] == want.text
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
            events = sse_events(
                server.http.post("/v1/completions", json={**body, "stream": True}).iter_lines()
            )
            chunks = [e["choices"][0] for e in events if isinstance(e, dict)]
            assert [t for c in chunks for t in c["token_ids"] or ()] == want.token_ids
            assert [d for c in chunks for d in c["exit_depths"]] == want.exit_depths
            assert "".join(c["text"] for c in chunks) == want.text
        # n > 1 with a seed: each choice equals the engine's
        want_n = [reference.generate([PROMPTS[0]], p)[0] for p in sampled]
        body = dict(prompt=PROMPTS[0], max_tokens=6, temperature=0.9, seed=11, n=2)
        body.update(exit_threshold=0.7, return_token_ids=True)
        choices = server.http.post("/v1/completions", json=body).json()["choices"]
        assert [c["token_ids"] for c in choices] == [o.token_ids for o in want_n]
        # a stop string: cut in the front end, the request finished in the core
        text = expected[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        [want_stop] = reference.generate(
            [PROMPTS[0]], SamplingParams(max_tokens=8, exit_threshold=0.8, stop=[stop])
        )
        body = dict(prompt=PROMPTS[0], max_tokens=8, exit_threshold=0.8, temperature=0.0)
        [choice] = server.http.post("/v1/completions", json={**body, "stop": [stop]}).json()[
            "choices"
        ]
        assert choice["text"] == want_stop.text and choice["finish_reason"] == "stop"
        # chat goes through the same path: non-streaming (one FINAL output per choice) equals
        # the stream's deltas concatenated
        messages = [{"role": "user", "content": "hello"}]
        body = dict(messages=messages, max_tokens=5, temperature=0.0, exit_threshold=0.8)
        chat = server.http.post("/v1/chat/completions", json=body).json()
        assert chat["choices"][0]["message"]["content"] is not None
        assert chat["usage"]["completion_tokens"] == 5
        events = sse_events(
            server.http.post("/v1/chat/completions", json={**body, "stream": True}).iter_lines()
        )
        deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
        streamed = "".join(d.get("content") or "" for d in deltas)
        assert streamed == chat["choices"][0]["message"]["content"]
        assert server.running() == 0 and server.metric("rlt:kv_cache_usage_perc") == 0.0


# The four engine requests of `RequestsInFlight` decode for half a minute or more on a CPU
# (they still run when the core dies), and fit the KV pool at once: 4 x 6000 tokens at full
# depth.
IN_FLIGHT_MAX_TOKENS = 6000
IN_FLIGHT_KV = ("--num-kv-blocks", "32768")


def test_a_killed_core_fails_requests_health_and_the_server(long_checkpoint):
    with serve(long_checkpoint, *IN_FLIGHT_KV) as server:
        group = descendants(server.process.pid)
        flight = RequestsInFlight(server.url, max_tokens=IN_FLIGHT_MAX_TOKENS).start()
        server.wait_running(flight.engine_requests)  # the plain one is in the core too
        os.kill(server.core_pid(), signal.SIGKILL)
        flight.assert_each_ended_unavailable()
        # after the death, until the server has stopped listening: 503s (then: refused)
        url = server.url + "/v1/completions"
        body = {"prompt": [1, 2], "max_tokens": 2000, "ignore_eos": True}
        with contextlib.suppress(httpx2.TransportError):
            late = httpx2.post(url, json=body, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
            health = httpx2.get(server.url + "/health", timeout=30)
            assert health.status_code == 503 and health.json()["status"] in (
                "dead",
                "shutting_down",
            )
        assert server.process.wait(timeout=EXIT_WAIT_S) == 1
        wait_gone(group)


def test_a_killed_front_end_takes_its_core_along(long_checkpoint):
    with serve(long_checkpoint) as server:
        core = server.core_pid()
        start_stream(server, {})
        server.process.kill()
        wait_gone([core])


def clients_of_every_front_end(server: Server, front_ends: set[int]) -> list[httpx2.Client]:
    """Keep-alive clients until each front end holds one of their connections at least (the
    kernel hands each new connection to one of them)."""
    clients = []
    for _ in range(40):
        clients.append(httpx2.Client(base_url=server.url, trust_env=False, timeout=60))
        assert clients[-1].get("/health").status_code == 200
        if all(tcp_sockets(p, ESTABLISHED, server.port) for p in front_ends):
            return clients
    raise AssertionError("40 connections all went to one front end")


def metric_total(text: str, name: str, **labels: tuple[str, ...]) -> float:
    """The sum of the samples of `name` whose labels take one of the given values."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(
            any(f'{label}="{value}"' in line for value in values)
            for label, values in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


FINISHED = ("stop", "length")  # the outcomes of requests answered in full


def test_two_api_servers_survive_the_death_of_one(long_checkpoint):
    with serve(long_checkpoint, "--api-server-count", "2") as server:
        supervisor = server.process.pid
        front_ends = {p for p in descendants(supervisor) if tcp_sockets(p, LISTEN)}
        assert len(front_ends) == 2
        # /metrics: each front end counts the requests it answered, a scrape of either shows
        # them all (and the engine's counters, read fresh from the core: the same on both)
        clients = clients_of_every_front_end(server, front_ends)
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        for http in clients:
            assert http.post("/v1/completions", json=body).status_code == 200
        answered = len(clients)
        scrapes = [http.get("/metrics").text for _ in range(3) for http in clients]
        requests = "rlt:http_requests_total"
        assert {metric_total(t, requests, outcome=FINISHED) for t in scrapes} == {answered}
        tokens = {metric_total(t, "rlt:generation_tokens_total") for t in scrapes}
        assert tokens == {3 * answered}
        for http in clients:
            http.close()
        for _ in range(4):
            start_stream(server, {})
        served = {p: tcp_sockets(p, ESTABLISHED, server.port) for p in front_ends}
        assert sum(served.values()) == 4, served
        victim = max(served, key=served.get)
        os.kill(victim, signal.SIGKILL)
        # the victim's requests are aborted in the core (their KV freed); the others run on
        deadline = time.monotonic() + EXIT_WAIT_S
        while server.running() != 4 - served[victim]:
            assert time.monotonic() < deadline, server.running()
            time.sleep(0.1)
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:  # a new API server takes the victim's place on the same socket
            now = {p for p in descendants(supervisor) if tcp_sockets(p, LISTEN)}
            if victim not in now and len(now) == 2:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert all(server.http.post("/v1/completions", json=body).status_code == 200 for _ in "ab")
        # the killed API server's counts stay in the totals
        text = server.http.get("/metrics").text
        assert metric_total(text, "rlt:http_requests_total", outcome=FINISHED) == answered + 2
        # the supervisor killed: the core and the API servers exit on their own
        group = descendants(supervisor)
        os.kill(supervisor, signal.SIGKILL)
        wait_gone(group)


def test_a_killed_core_under_two_api_servers_ends_them_all(long_checkpoint):
    with serve(long_checkpoint, "--api-server-count", "2", *IN_FLIGHT_KV) as server:
        group = descendants(server.process.pid)
        flight = RequestsInFlight(server.url, max_tokens=IN_FLIGHT_MAX_TOKENS).start()
        server.wait_running(flight.engine_requests)
        directories = {metrics_directory(p) for p in group if tcp_sockets(p, LISTEN)}
        os.kill(server.core_pid(), signal.SIGKILL)
        flight.assert_each_ended_unavailable()  # whichever front end each one reached
        assert server.process.wait(timeout=EXIT_WAIT_S) == 1
        wait_gone(group)
        # the front ends shared one metrics directory; the supervisor removed it at its exit
        [directory] = directories
        assert directory.name.startswith("rlt-metrics-") and not directory.exists()


def metrics_directory(pid: int) -> Path:
    """The prometheus-client multi-process directory whose files the process has mapped."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = Path(line.split()[-1])
        if path.name.endswith(".db") and path.parent.name.startswith("rlt-metrics-"):
            return path.parent
    raise AssertionError(f"process {pid} maps no metrics file")
