"""`rlt ray serve` and `rlt ray pd serve` as commands (the console script under `uv run`, CPU,
the bundled model), each started once and shared by the cases below, while the suite's
three-node test cluster (conftest.py) runs: it plays "another Ray cluster on this machine",
whose address is in Ray's last-cluster file, and it runs a Serve app named `rlt` at `/`.

`rlt ray serve` without --address and without RAY_ADDRESS:
- starts a private cluster in a POSIX session of its own, serves a streaming and a plain
  completion at the URL it prints, and leaves the other cluster alone (its app, its nodes);
- when its engine replica is SIGKILLed under a streaming and a plain request, the stream ends
  with a last "abort" chunk, the error event (503 engine_unavailable) and [DONE], the plain
  request with a JSON 503, and Ray's replacement serves;
- on a process-group SIGINT (uv forwards a second copy) it drains: a request that fits in
  --shutdown-timeout completes, a stream and a plain request that do not end with
  finish_reason "abort" (the stream with its last chunk and [DONE], the plain one 200 with its
  partial text), a new request gets 503; it exits 0 with no traceback and leaves no process.

`rlt ray pd serve --num-prefill 1 --num-decode 1` with RAY_ADDRESS naming the test cluster:
- joins it (and says so), deploys under --app-name / --route-prefix, prints the URL that
  serves (the cluster's Serve port, not --port), serves a streaming and a plain completion;
- on a process-group SIGINT it exits 0 with no traceback, having removed only its own app.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from ray_commands import (
    PRIVATE,
    READY,
    Command,
    choice_text,
    command_env,
    kill_session,
    post_plain,
    private_session,
    session_processes,
)
from ray_test_streams import Stream

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rlt-ray-cluster")]

START_S = 420  # a loaded 2-core machine: a private cluster (maybe started again) and a replica
# --shutdown-timeout of the drain test: far less than the 1000-token requests need (10 s even
# at 100 tokens/s), far more than an 8-token one does
GRACE_S = 5
IDLE_EXIT_S = 20  # from SIGINT to exit with nothing in flight ("well under" Ray's 30 s)
SENTINEL_APP = "rlt"  # the other cluster's app: the name and route `rlt ray serve` defaults to
DRAINING = re.compile(r"rlt ray: SIGINT: draining")
STATS_LINE = re.compile(
    r"ServeReplica:.*rlt\.engine\.stats: engine: .*generation throughput ([\d,.]+) tok/s, .*"
    r"loops per token ([\d.]+)"
)


@pytest.fixture(scope="module")
def other_cluster(ray_cluster):
    """The test cluster with a Serve app of its own named `rlt` at `/` (what an accidental
    join would replace)."""
    from ray import serve

    @serve.deployment(
        name="Sentinel", ray_actor_options={"num_cpus": 0, "resources": {"rlt_head": 1}}
    )
    class Sentinel:
        def __call__(self, request) -> str:
            return "sentinel"

    serve.run(Sentinel.bind(), name=SENTINEL_APP, route_prefix="/")
    try:
        yield ray_cluster
    finally:
        serve.delete(SENTINEL_APP)


def cluster_view(cluster) -> dict:
    """What must not change on the other cluster: its live nodes, its resources, its apps,
    and what its app answers."""
    import ray
    from ray import serve

    apps = serve.status().applications
    return {
        "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
        "resources": ray.cluster_resources(),
        "apps": {name: (app.status, app.last_deployed_time_s) for name, app in apps.items()},
        "answer": httpx.get(f"{cluster.url}/", timeout=30, trust_env=False).text,
    }


# -- rlt ray serve: a private cluster ----------------------------------------------------------
@dataclass
class ServeCommand:
    command: Command
    url: str
    session: int  # the private cluster's POSIX session
    before: dict  # the other cluster's view before the command started


@pytest.fixture(scope="module")
def serve_command(other_cluster):
    before = cluster_view(other_cluster)
    from rlt_ray.local_cluster import free_port

    started = time.monotonic()
    command = Command(
        ["serve", "--port", str(free_port()), "--shutdown-timeout", str(GRACE_S)]
        + ["--stats-interval", "1"],  # the replica's live statistics lines (issue 41)
        command_env(),
    )
    session = None
    try:
        url = command.wait_for_line(READY, START_S).group(1)
        session = private_session(command.wait_for_line(PRIVATE, 1).group(2))
        print(f"\nrlt ray serve ready in {time.monotonic() - started:.1f} s at {url}")
        yield ServeCommand(command, url, session, before)
    finally:
        command.kill()
        if session is not None:
            kill_session(session)


def engine_replicas(session: int) -> list[int]:
    return [
        pid
        for pid, line in session_processes(session).items()
        if line.startswith(f"ray::ServeReplica:{SENTINEL_APP}:RltEngine")
    ]


def test_ray_serve_runs_on_a_private_cluster_in_its_own_session(serve_command, other_cluster):
    run = serve_command
    address = run.command.wait_for_line(PRIVATE, 1).group(1)
    assert address != other_cluster.cluster.address
    assert run.url != other_cluster.url
    stream = Stream(run.url, "It is a truth universally acknowledged", 12)
    plain = post_plain(run.url, 12)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    events = stream.result(timeout=120)
    assert stream.status == 200 and events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert choice_text(events)
    # the engine replica's live statistics line reaches this console (Ray streams its stderr)
    stats = run.command.wait_for_line(STATS_LINE, 30)
    assert float(stats.group(1).replace(",", "")) > 0 and 1.0 <= float(stats.group(2)) <= 4.0
    # the other cluster: untouched (its `rlt` app still answers at `/`)
    assert cluster_view(other_cluster) == run.before
    # Ray's processes (GCS, raylet, the replicas) run in a session that is not the command's:
    # a terminal's Ctrl-C reaches only the command
    assert run.session != os.getsid(run.command.process.pid)
    lines = session_processes(run.session).values()
    assert any("gcs_server" in line for line in lines), lines
    assert any("raylet" in line for line in lines), lines
    assert len(engine_replicas(run.session)) == 1, lines


def test_a_replica_killed_mid_request_fails_its_requests_cleanly(serve_command):
    """SIGKILL of the engine replica's process under a plain and a streaming request: the
    stream's last events are an error event and [DONE], the plain request gets a JSON 503
    (engine_unavailable, as a lost PD instance); Ray then starts a new replica, which
    serves."""
    run = serve_command
    [replica] = engine_replicas(run.session)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(post_plain, run.url, 1000, ignore_eos=True)  # sent first
        stream = Stream(run.url, "A stream cut by a lost replica:", 1000)
        assert stream.started.wait(120), stream.progress()
        os.kill(replica, signal.SIGKILL)
        events = stream.result(timeout=120)
        answer = plain.result(timeout=120)
    assert stream.status == 200 and events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert error["code"] == "engine_unavailable", error
    assert "lost engine replica" in error["message"], error
    assert events[-3]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_unavailable"
    assert "lost engine replica" in answer.json()["error"]["message"]
    # the replacement serves (a request waits for it: the ingress's submit timeout is 60 s)
    deadline = time.monotonic() + 180
    while (again := post_plain(run.url, 4)).status_code != 200:
        assert time.monotonic() < deadline, again.text
        time.sleep(1)
    assert engine_replicas(run.session) not in ([], [replica])


def test_ray_serve_drains_on_sigint_and_exits_0(serve_command, other_cluster):
    run = serve_command
    command, url = run.command, run.url
    long_stream = Stream(url, "A stream that outlasts the grace period:", 1000)
    assert long_stream.started.wait(120), long_stream.progress()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_plain = pool.submit(post_plain, url, 1000, ignore_eos=True)
        short_stream = Stream(url, "A stream that fits in the grace period:", 8)
        assert short_stream.started.wait(120), short_stream.progress()
        signalled = time.monotonic()
        command.interrupt_group()  # uv gets it too and forwards a copy: one drain
        command.wait_for_line(DRAINING, 60)
        refused = _refused_while_draining(url, deadline_s=GRACE_S / 2)
        code = command.wait(GRACE_S + 60)
        stopped_s = time.monotonic() - signalled
        plain = long_plain.result(timeout=60)
    print(f"\nrlt ray serve: SIGINT -> exit {code} in {stopped_s:.1f} s")
    output = command.output
    assert code == 0, output
    assert "Traceback" not in output, output
    assert stopped_s < GRACE_S + 30, output
    # a new request during the drain: 503 engine_unavailable
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_unavailable"
    # what fit in the grace period completed
    events = short_stream.result(timeout=30)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    # what did not: aborted, its text kept, the stream ended properly
    events = long_stream.result(timeout=30)
    assert long_stream.status == 200 and events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert choice_text(events)
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] < 1000
    # nothing left: the command's group, the private cluster's session and directory
    assert not command.group_alive()
    assert session_processes(run.session) == {}
    temp_dir = command.wait_for_line(PRIVATE, 1).group(2)
    assert not os.path.exists(temp_dir)
    assert cluster_view(other_cluster) == run.before


def _refused_while_draining(url: str, deadline_s: float) -> httpx.Response:
    """A one-token request, repeated until the ingress has seen the drain (it polls the
    signal every 0.25 s): the answer it then gives."""
    deadline = time.monotonic() + deadline_s
    while True:
        response = post_plain(url, 1)
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


# -- rlt ray pd serve: joining a cluster through RAY_ADDRESS ---------------------------------
PD_APP = "rlt-pd-command"
PD_ROUTE = "/pd"


@pytest.fixture(scope="module")
def pd_command(other_cluster):
    pytest.importorskip("nixl")
    from rlt_ray.local_cluster import free_port

    started = time.monotonic()
    argv = ["pd", "serve", "--num-prefill", "1", "--num-decode", "1"]
    argv += ["--prefill-resource", "rlt_prefill=1", "--decode-resource", "rlt_decode=1"]
    argv += ["--num-cpus-per-replica", "0", "--app-name", PD_APP, "--route-prefix", PD_ROUTE]
    argv += ["--port", str(free_port()), "--shutdown-timeout", "2"]
    command = Command(argv, command_env(RAY_ADDRESS=other_cluster.cluster.address))
    try:
        url = command.wait_for_line(READY, START_S).group(1)
        print(f"\nrlt ray pd serve ready in {time.monotonic() - started:.1f} s at {url}")
        yield command, url
    finally:
        command.kill()
        from ray import serve

        if PD_APP in serve.status().applications:
            serve.delete(PD_APP)


def test_ray_pd_serve_joins_the_cluster_ray_address_names(pd_command, other_cluster):
    command, url = pd_command
    address = other_cluster.cluster.address
    assert f"joining the Ray cluster at {address} (from RAY_ADDRESS)" in command.output
    # the URL that serves: the cluster's Serve port (its HTTP options stay), the route prefix
    assert url == f"{other_cluster.url}{PD_ROUTE}"
    stream = Stream(url, "It is a truth universally acknowledged", 12)
    plain = post_plain(url, 12)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    events = stream.result(timeout=120)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_ray_pd_serve_stops_on_sigint_removing_only_its_app(pd_command, other_cluster):
    from ray import serve

    command, url = pd_command
    assert PD_APP in serve.status().applications
    signalled = time.monotonic()
    command.interrupt_group()
    code = command.wait(IDLE_EXIT_S + 40)
    stopped_s = time.monotonic() - signalled
    print(f"\nrlt ray pd serve: SIGINT -> exit {code} in {stopped_s:.1f} s")
    output = command.output
    assert code == 0, output
    assert "Traceback" not in output, output
    assert stopped_s < IDLE_EXIT_S, output
    assert not command.group_alive()
    apps = serve.status().applications
    assert PD_APP not in apps and SENTINEL_APP in apps, apps
    assert httpx.get(f"{other_cluster.url}/", timeout=30, trust_env=False).text == "sentinel"
