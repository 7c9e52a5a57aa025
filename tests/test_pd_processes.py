"""PD disaggregation with real processes: `rlt pd serve` starts prefill and decode engine
instances (`rlt serve --pd-role ...`) as children and fronts them; KV moves between the
instances through NIXL (UCX over host memory on loopback).

Checked over HTTP: PD output equals a single engine's (tokens and exit depths; greedy and
seeded; both KV layouts; refill and no_refill; chunked prefill; prompts ending mid-block;
prefix-cache hits on D); a client that goes away mid-transfer leaves both instances with
every block free; a prefill (decode) instance killed mid-transfer fails its request with a
clear error while the other side frees everything and the next requests use the surviving
instances; `uv run rlt pd serve` stopped by a SIGINT to its process group answers the
requests in flight as `rlt serve` does (200, partial text, finish_reason "abort").

Starting a group (the coordinator and its children, each importing torch) is most of these
tests' time, so all but the first two share one group of two prefill and two decode instances
(`group`), in the order they are written: each waits until every instance is ready and idle
(the supervisor restarts a killed child), and they run on one xdist worker.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from in_flight_failures import UNAVAILABLE, RequestsInFlight
from launcher_harness import UV, InFlight, Launch, check_stopped_cleanly
from rlt import LLM, SamplingParams
from rlt_serve.shutdown import STOP_BOUND_MARGIN_S

pytest.importorskip("nixl")

# each test uses a PD group of processes; the shared group's tests run on one worker, in order
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pd-processes")]

ENGINE_FLAGS = dict(
    dtype="float32",
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)
# Short transfer leases so that failure paths finish within a test (docs/pd.md, failures).
KV_TIMEOUT_S, KV_LEASE_S = 30, 3
# The shared group's engine settings (the prefix cache on, for hits on D).
SHARED_FLAGS = dict(kv_layout="last_exited", enable_prefix_caching=True, num_kv_blocks=1024)
PD_FLAGS = ["--pd-write-timeout-s", "2", "--pd-kv-lease-s", str(KV_LEASE_S)]
PD_FLAGS += ["--pd-kv-timeout-s", str(KV_TIMEOUT_S)]

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13],  # ends mid-block
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17],  # 3 pages shared with #0
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3, 7, 7, 7, 9, 12, 100, 101, 102, 103, 104],
]


def request_params(i: int) -> dict:
    return dict(
        max_tokens=6 + i,
        exit_threshold=(0.55, 0.8, 1.0)[i % 3],
        ignore_eos=True,
        temperature=0.0 if i % 2 else 0.9,
        seed=40 + i,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Group:
    def __init__(self, process: subprocess.Popen, url: str, model: str) -> None:
        self.process, self.url, self.model = process, url, model
        self.http = httpx.Client(base_url=url, timeout=60, trust_env=False)

    def instances(self) -> list[dict]:
        return self.http.get("/v1/pd/instances").json()["instances"]

    def complete(self, prompt: list[int], **params) -> dict:
        body = {"model": self.model, "prompt": prompt, "return_token_ids": True, **params}
        response = self.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    def instance_info(self, instance: dict) -> dict:
        headers = {"Authorization": f"Bearer {os.environ['RLT_INSTANCE_API_KEY']}"}
        with httpx.Client(trust_env=False, timeout=10) as http:
            return http.get(instance["url"] + "/internal/pd/info", headers=headers).json()

    def wait_all_free(self, timeout: float = 20.0) -> None:
        """Every live instance reports no request and every KV block free."""
        deadline = time.monotonic() + timeout
        while True:
            loads = [
                self.instance_info(i)["load"] for i in self.instances() if i["state"] == "ready"
            ]
            if loads and all(
                load["kv_blocks_free"] == load["kv_blocks_total"]
                and load["running"] == load["waiting"] == 0
                for load in loads
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"instances still hold work or blocks: {loads}")
            time.sleep(0.1)

    def wait_ready(self, prefill: int, decode: int, timeout: float = 120.0) -> None:
        """At least this many instances of each role are ready (an earlier test's victim may
        still be restarting) and every ready one is idle."""
        deadline = time.monotonic() + timeout
        while True:
            instances = self.instances()
            ready = [i["role"] for i in instances if i["state"] == "ready"]
            if ready.count("prefill") >= prefill and ready.count("decode") >= decode:
                break
            states = [(i["name"], i["state"]) for i in instances]
            assert time.monotonic() < deadline, f"not {prefill} P + {decode} D ready: {states}"
            time.sleep(0.2)
        self.wait_all_free()


@contextlib.contextmanager
def pd_group(
    model: str, *, num_prefill: int = 1, num_decode: int = 1, flags: dict
) -> Iterator[Group]:
    port = free_port()
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE_FLAGS, **flags}.items()]
    engine = [e.removesuffix("=True") for e in engine]
    command = [sys.executable, "-m", "rlt.cli", "pd", "serve", model]
    command += [
        "--num-prefill",
        str(num_prefill),
        "--num-decode",
        str(num_decode),
        "--port",
        str(port),
    ]
    command += ["--device", "cpu", "--log-level", "warning", "--transfer-timeout", "20"]
    command += engine + PD_FLAGS
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    group = Group(process, f"http://127.0.0.1:{port}", os.path.basename(model))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"rlt pd serve exited with {process.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if group.http.get("/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the PD group did not become healthy"
            time.sleep(0.25)
        yield group
    finally:
        group.http.close()
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from rlt_models import OuroConfig, RandomInit, write_random_checkpoint

    config = OuroConfig(
        vocab_size=256 + 8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        total_ut_steps=4,
        max_position_embeddings=512,
    )
    out = tmp_path_factory.mktemp("pd_model")
    return str(write_random_checkpoint(out, config, seed=3, init=RandomInit(gate_std=0.3)))


@pytest.fixture(scope="module", autouse=True)
def instance_key():
    """The key the coordinator and its children share (read from the environment), set for
    the module: the shared group starts before any function-scoped fixture."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLT_INSTANCE_API_KEY", "pd-test-key")
        yield


_REFERENCES: dict[tuple, list[tuple[list[int], list[int]]]] = {}


def reference(model: str, flags: dict) -> list[tuple[list[int], list[int]]]:
    """A single engine's outputs for PROMPTS (computed once per model and flags)."""
    key = (model, tuple(sorted(flags.items())))
    if key not in _REFERENCES:
        options = {**ENGINE_FLAGS, **flags, "device": "cpu"}
        with LLM(model, **options) as llm:
            params = [SamplingParams(**request_params(i)) for i in range(len(PROMPTS))]
            outputs = llm.generate(PROMPTS, params)
        _REFERENCES[key] = [(o.token_ids, o.exit_depths) for o in outputs]
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def group(model) -> Iterator[Group]:
    """Two prefill and two decode instances with SHARED_FLAGS, for the tests below."""
    with pd_group(model, num_prefill=2, num_decode=2, flags=SHARED_FLAGS) as shared:
        yield shared  # (Ctrl-C may find a killed child restarting: it stops cleanly all the same)


def check_equal_to_a_single_engine(group: Group, expected: list) -> None:
    got = []
    for i, prompt in enumerate(PROMPTS):
        choice = group.complete(prompt, **request_params(i))
        got.append((choice["token_ids"], choice["exit_depths"]))
    assert got == expected
    # again, all at once: batched on D, prefix hits on D for the repeated prompts
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(group.complete, prompt, **request_params(i))
            for i, prompt in enumerate(PROMPTS)
        ]
        again = [(f.result()["token_ids"], f.result()["exit_depths"]) for f in futures]
    assert again == expected
    group.wait_all_free()


def test_pd_over_processes_with_the_shared_layout_and_no_refill_equals_a_single_engine(model):
    flags = dict(kv_layout="shared", scheduling_mode="no_refill")  # a group of its own
    with pd_group(model, flags=flags) as group:
        check_equal_to_a_single_engine(group, reference(model, flags))


@pytest.mark.skipif(UV is None, reason="started with `uv run`, as the README starts it")
def test_a_process_group_sigint_under_uv_run_answers_in_flight_requests_as_rlt_serve_does():
    """`uv run rlt pd serve --num-prefill 1 --num-decode 1` (the bundled model: requests long
    enough to outlive the drain) stopped by a SIGINT to its process group (uv forwards a copy
    200 ms later) while a stream and a plain request run: both answer 200 with their partial
    text and finish_reason "abort" (the stream: its last chunk, then `[DONE]`), never a 500;
    exit 0, no traceback (no CancelledError), no process left (the instances too)."""
    grace_s, port = 1.0, free_port()
    launch = Launch(
        "rlt",
        "pd",
        "serve",
        "--num-prefill",
        "1",
        "--num-decode",
        "1",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--shutdown-timeout",
        str(grace_s),
        port=port,
    )
    try:
        launch.wait_healthy(timeout=180)
        long = {"prompt": "It is a truth", "max_tokens": 1000, "ignore_eos": True}
        in_flight = InFlight(launch.base_url, long=long)
        in_flight.start()
        sent = launch.signal_group(signal.SIGINT)
        output = check_stopped_cleanly(launch, sent, grace_s + STOP_BOUND_MARGIN_S)
        in_flight.check_answered()
        assert "500 Internal Server Error" not in output, output
    finally:
        launch.kill()


def test_pd_over_processes_equals_a_single_engine(model, group):
    group.wait_ready(2, 2)
    check_equal_to_a_single_engine(group, reference(model, SHARED_FLAGS))


def test_client_gone_mid_transfer_frees_both_sides(model, group):
    group.wait_ready(2, 2)
    long_prompt = [(7 * i) % 250 + 1 for i in range(400)]
    for delay in (0.05, 0.3, 1.0):
        body = {"model": group.model, "prompt": long_prompt, "max_tokens": 50, "stream": True}
        with contextlib.suppress(httpx.ReadTimeout):
            with httpx.Client(base_url=group.url, timeout=delay, trust_env=False) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
        group.wait_all_free()
    # the instances serve on, with the same results as before
    choice = group.complete(PROMPTS[0], **request_params(1))
    assert len(choice["token_ids"]) == request_params(1)["max_tokens"]
    group.wait_all_free()


@pytest.mark.parametrize("victim_role", ["prefill", "decode"])
def test_a_killed_instance_fails_its_request_and_the_survivors_serve(model, group, victim_role):
    """SIGKILL the prefill (or decode) instance while P computes a long prompt and pushes its
    KV: the request fails with a clear error; the other side frees everything (D after its
    lease, P once its writes failed or their lease expired); the next requests go to the
    surviving instances with correct output."""
    # a survivor of the victim's role (the prefill victim, killed first, may be restarting)
    group.wait_ready(2 if victim_role == "prefill" else 1, 2)
    long_prompt = [(11 * i) % 250 + 1 for i in range(480)]
    body = {"model": group.model, "prompt": long_prompt, "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(group.http.post, "/v1/completions", json=body)
        victim = busy = None
        deadline = time.monotonic() + 30
        while busy is None and time.monotonic() < deadline:
            instances = group.instances()
            for instance in instances:  # P is computing the prompt
                if (
                    instance["role"] == "prefill"
                    and instance["in_flight"]
                    and group.instance_info(instance)["load"]["running"]
                ):
                    busy = instance
            time.sleep(0.005)
        assert busy is not None, "the request never ran on a prefill instance"
        if victim_role == "prefill":
            victim = busy
        else:
            victim = next(i for i in instances if i["role"] == "decode" and i["in_flight"])
        os.kill(victim["pid"], signal.SIGKILL)
        response = pending.result(timeout=60)
    # the instance was lost (503); a decode instance's death may be reported first by P,
    # whose KV writes to it failed (500)
    assert response.status_code in ((503,) if victim_role == "prefill" else (500, 503))
    error = response.json()["error"]
    if response.status_code == 503:
        assert (error["type"], error["code"]) == UNAVAILABLE
    assert victim_role in error["message"]
    expected = reference(model, SHARED_FLAGS)
    for i in (0, 2):
        choice = group.complete(PROMPTS[i], **request_params(i))
        assert (choice["token_ids"], choice["exit_depths"]) == expected[i]
    # D frees a dead P's transfer at the latest when its KV wait times out, plus the lease
    group.wait_all_free(timeout=KV_TIMEOUT_S + KV_LEASE_S + 10)


def test_killed_decode_instances_end_every_stream_with_the_error_event(group):
    """SIGKILL of the decode instances serving a streaming completion, a streaming chat with
    n = 2 (both with usage) and a non-streaming completion, once every handoff is done and
    they decode: each stream ends with its choices' last chunks, the usage chunk, the 503
    error event and [DONE]; the plain request answers 503. (Last in the module: the group is
    left restarting its decode instances.)"""
    group.wait_ready(2, 2)
    # 4 requests of at most 230 tokens fit one decode instance's KV (1024 tokens)
    flight = RequestsInFlight(group.url, max_tokens=200, model=group.model).start()
    deadline = time.monotonic() + 60
    trace = []
    while True:  # every request on a decode instance, none in a handoff any more
        instances = group.instances()
        trace.append((round(time.monotonic() - deadline, 2), [i["in_flight"] for i in instances]))
        decoding = [i for i in instances if i["role"] == "decode" and i["in_flight"]]
        handoffs = sum(i["in_flight"] for i in instances if i["role"] == "prefill")
        if not handoffs and sum(i["in_flight"] for i in decoding) == flight.engine_requests:
            break
        assert time.monotonic() < deadline, trace[:: max(len(trace) // 60, 1)]
        time.sleep(0.02)
    for victim in decoding:
        os.kill(victim["pid"], signal.SIGKILL)
    flight.assert_each_ended_unavailable()
    for call in (flight.completion, flight.chat):
        assert "decode instance" in call.events()[-2]["error"]["message"]
