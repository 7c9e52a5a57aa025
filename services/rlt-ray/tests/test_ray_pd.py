"""`rlt ray pd serve` on the session's local three-node Ray cluster (conftest.py; CPU, the
bundled model, KV over NIXL/UCX between processes on different Ray nodes).

One prefill replica on the head node, one decode replica on each worker node (custom
resources `rlt_prefill` / `rlt_decode`): every handoff crosses nodes. The ingress is
rlt-pd-coordinator's coordinator; it learns the replicas from Ray.

(b) PD through Ray equals one in-process engine (token ids and exit depths, greedy with early
    exits, chunked prefill and prompts ending mid-block);
failure: a decode replica SIGKILLed while it streams one request and receives the KV of
    another: those requests end with clean errors naming the decode instance, the request on
    the other decode replica completes, no KV block or transfer stays held on the survivors,
    and Ray's replacement is a new handoff generation (a new transport agent), holds no
    transfer, is admitted and connected by the coordinator and serves correct output.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
from ray_test_streams import Stream

pytest.importorskip("nixl")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rlt-ray-cluster")]

APP = "rlt-pd"
EXIT_THRESHOLD = 0.5
# Small pages and chunks: a prompt is several chunks and KV partitions, pages end mid-prompt.
ENGINE = dict(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=1024,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)
# Short transfer leases so that failure paths finish within a test (docs/pd.md, failures).
PD_TIMEOUTS = dict(pd_write_timeout_s=2.0, pd_kv_lease_s=3.0, pd_kv_timeout_s=30.0)
PROMPTS = [
    "It is a truth universally acknowledged",
    "My dear Emma,",
    "The village lay quiet under the snow, and the lamps were lit along the road",
]


class PDFleet:
    def __init__(self, url: str) -> None:
        self.url = url

    def ingress(self):
        from ray import serve

        return serve.get_app_handle(APP)

    def instances(self) -> list[dict]:
        return self.ingress().instances.remote().result(timeout_s=30)

    def by_role(self, role: str) -> list[dict]:
        return [i for i in self.instances() if i["role"] == role]

    def wait_for(self, predicate, timeout_s: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            views = self.instances()
            if predicate(views):
                return views
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {views}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def pd_fleet(ray_cluster):
    from ray import serve
    from rlt.engine.config import EngineConfig
    from rlt_pd_coordinator import CoordinationOptions
    from rlt_ray import PDOptions, build_pd_app
    from rlt_serve.front_options import ServeOptions

    ray_cluster.ensure_nodes("rlt_decode", 2)  # an earlier test may have removed a worker
    started = time.monotonic()
    app = build_pd_app(
        EngineConfig.from_options(**ENGINE, **PD_TIMEOUTS),
        ServeOptions(host="127.0.0.1"),
        PDOptions(
            num_prefill=1,
            num_decode=2,
            num_cpus=0,
            prefill_resources={"rlt_prefill": 1},
            decode_resources={"rlt_decode": 1},
            ingress_resources={"rlt_head": 1},
            # (each period wakes every replica and the ingress: on a loaded 2-core machine
            # short ones slow everything else)
            coordination=CoordinationOptions(
                admission_timeout=30, transfer_timeout=30, poll_interval=1.0
            ),
            discovery_period_s=0.5,
            health_check_period_s=2,
            health_check_timeout_s=30,
        ),
    )
    serve.run(app, name=APP, route_prefix="/")
    try:
        fleet = PDFleet(ray_cluster.url)
        fleet.wait_for(
            lambda views: sum(v["state"] == "ready" for v in views) == 3, 60, "1 P + 2 D ready"
        )
        print(f"\nrlt ray pd serve app up in {time.monotonic() - started:.1f} s")
        yield fleet
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def reference():
    """One in-process whole engine with the instances' settings: (token ids, exit depths)
    per prompt and max_tokens."""
    import torch
    from rlt import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache: dict = {}
    try:
        with LLM(**ENGINE) as llm:

            def run(prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
                key = (prompt, max_tokens)
                if key not in cache:
                    params = SamplingParams(
                        max_tokens=max_tokens, temperature=0, exit_threshold=EXIT_THRESHOLD
                    )
                    [out] = llm.generate([prompt], params, use_tqdm=False)
                    cache[key] = (list(out.token_ids), list(out.exit_depths))
                return cache[key]

            yield run
    finally:
        torch.set_num_threads(threads)


def complete(fleet: PDFleet, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {
        "model": "default_model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "exit_threshold": EXIT_THRESHOLD,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=120)


def assert_idle(view: dict) -> None:
    """No request, KV block or transfer held on this instance (its replica's last report)."""
    report = view["report"]
    assert report["kv_blocks_total"] > 0, view
    assert report["kv_blocks_free"] == report["kv_blocks_total"], view
    assert not report["pd_busy"] and report["ongoing"] == 0, view


def wait_idle(fleet: PDFleet, names: set[str], timeout_s: float = 20) -> list[dict]:
    def idle(views):
        chosen = [v for v in views if v["name"] in names]
        return len(chosen) == len(names) and all(
            v["report"].get("kv_blocks_free") == v["report"].get("kv_blocks_total")
            and not v["report"].get("pd_busy")
            and v["report"].get("ongoing") == 0
            for v in chosen
        )

    views = fleet.wait_for(idle, timeout_s, f"{sorted(names)} idle")
    for view in views:
        if view["name"] in names:
            assert_idle(view)
    return views


# -- (b) ----------------------------------------------------------------------------------------
def test_pd_across_nodes_matches_one_engine(pd_fleet, reference):
    views = pd_fleet.instances()
    [prefill] = [v for v in views if v["role"] == "prefill"]
    decodes = [v for v in views if v["role"] == "decode"]
    assert len(decodes) == 2
    p_node = prefill["report"]["node_id"]
    d_nodes = {d["report"]["node_id"] for d in decodes}
    assert p_node not in d_nodes and len(d_nodes) == 2, views  # three different nodes

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: complete(pd_fleet, p, 10), PROMPTS))
    early = False
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        tokens, depths = reference(prompt, 10)
        assert choice["token_ids"] == tokens, prompt
        assert choice["exit_depths"] == depths, prompt
        early |= any(d < 4 for d in depths)
    assert early  # early exits happened: exit depths were carried across the handoff
    wait_idle(pd_fleet, {v["name"] for v in views})


# -- failure ------------------------------------------------------------------------------------
def _result(stream: Stream, timeout_s: float, what: str, fleet: PDFleet) -> list:
    """The stream's events; if it did not end, what each instance holds is in the error."""
    try:
        return stream.result(timeout_s, what)
    except AssertionError as exc:
        views = [
            {k: v.get(k) for k in ("name", "role", "state", "in_flight", "reason")}
            | {k: v["report"].get(k) for k in ("running", "waiting", "ongoing", "pd_busy")}
            for v in fleet.instances()
        ]
        raise AssertionError(f"{exc}; {views}") from None


def _decode_in_flight(fleet: PDFleet) -> dict[str, int]:
    return {v["name"]: v["in_flight"] for v in fleet.by_role("decode")}


def test_killed_decode_replica_fails_only_its_requests_and_its_replacement_is_clean(
    pd_fleet, reference
):
    before = {v["name"]: v for v in pd_fleet.instances()}
    [p_name] = [n for n, v in before.items() if v["role"] == "prefill"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # two streams, one per decode replica (least loaded first)
        streams = {}
        for prompt in ("Stream one: the long night", "Stream two: the morning"):
            stream = Stream(pd_fleet.url, prompt, 200)
            assert stream.started.wait(60) and stream.running, (stream.status, stream.events)
            [name] = [
                n for n, k in _decode_in_flight(pd_fleet).items() if k == 1 and n not in streams
            ]
            streams[name] = stream
        # a third request with a long prompt (many chunks and KV partitions): the decode
        # replica it went to is killed while P is still prefilling and writing its KV there
        long_prompt = "Emma Woodhouse, handsome, clever, and rich, " * 30
        third = pool.submit(complete, pd_fleet, long_prompt, 8)
        views = pd_fleet.wait_for(
            lambda vs: any(v["name"] == p_name and v["in_flight"] == 1 for v in vs),
            30,
            "the third request's handoff",
        )
        [victim] = [v["name"] for v in views if v["role"] == "decode" and v["in_flight"] == 2]
        [survivor] = [n for n in streams if n != victim]
        os.kill(int(before[victim]["report"]["pid"]), signal.SIGKILL)
        killed_at = time.monotonic()

        events = _result(streams[victim], 120, "the killed replica's stream", pd_fleet)
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]["message"]
        assert "decode instance" in error and victim in error, error
        # its KV was being written to the killed process: whichever side notices first names
        # it (the coordinator: D's stream broke; P: its write to D's agent failed)
        response = third.result(timeout=120)
        # 503 when the coordinator saw D's stream break first (an instance lost), 500 when
        # P reported its failed write first (docs/serving.md: what a client sees)
        assert response.status_code in (500, 503), response.text
        message = response.json()["error"]["message"]
        assert victim in message or before[victim]["agent"] in message, message
        # (a slow machine: the replacement starts meanwhile; a stall says how far it got)
        survivor_events = _result(streams[survivor], 240, "the other stream", pd_fleet)
        assert not any(isinstance(e, dict) and "error" in e for e in survivor_events)
        chunks = [e for e in survivor_events if isinstance(e, dict) and e.get("choices")]
        assert sum(len(c["choices"][0].get("exit_depths") or []) for c in chunks) == 200
    print(f"\nthird request failed: {response.json()['error']['message']}")

    # the survivors hold nothing: P freed what it was writing (its writes to the dead process
    # failed or timed out), the other D finished its stream
    wait_idle(pd_fleet, {p_name, survivor})

    # Ray's replacement: a new replica id and a new transport agent (a new handoff
    # generation), admitted and connected by the coordinator, holding no transfer
    old_agents = {v["agent"] for v in before.values()}
    views = pd_fleet.wait_for(
        lambda vs: (
            sum(v["role"] == "decode" and v["state"] == "ready" for v in vs) == 2
            and victim not in {v["name"] for v in vs}
        ),
        90,
        "a replacement decode replica",
    )
    print(f"replacement ready {time.monotonic() - killed_at:.1f} s after the kill")
    [new] = [v for v in views if v["role"] == "decode" and v["name"] not in before]
    assert new["agent"] and new["agent"] not in old_agents, new
    assert new["report"]["node_id"] == before[victim]["report"]["node_id"]  # its rlt_decode
    assert_idle(new)

    # it serves (the coordinator prefers it: nothing in flight, never picked) and correctly
    prompt = PROMPTS[2]
    response = complete(pd_fleet, prompt, 10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == reference(prompt, 10)[0]
    assert response.json()["choices"][0]["exit_depths"] == reference(prompt, 10)[1]
    views = wait_idle(pd_fleet, {p_name, survivor, new["name"]})
    served = {v["name"]: v for v in views}
    assert served[new["name"]]["state"] == "ready"
