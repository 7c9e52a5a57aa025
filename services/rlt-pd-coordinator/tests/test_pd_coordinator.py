"""The PD coordinator end to end over fake engine instances (the coordinator's test support,
services/rlt-pd-coordinator/tests/fake_engine.py).

The fakes speak the engine side's internal protocol (/internal/pd/info, connect, generate)
with scripted deltas and failures; the coordinator's front is rlt-serve's app, served by
uvicorn on an OS-chosen port. Covered: completions and chat (streaming and not, exit depths
and loop usage as on a single engine), least-loaded routing, credits, a failing / broken /
hung prefill instance, a dead decode instance (mid-stream and idle), compatibility refused at
connect naming the field, the plain router's balance, cancellation closing both connections,
(`rlt pd serve` as a process, which loads the rlt engine's bundled model's tokenizer:
tests/test_pd_serve_process.py in the workspace).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from fake_engine import (
    DEFAULT_COMPATIBILITY,
    FAKE_MODEL_INFO,
    CharTokenizer,
    FakeEngine,
    serve_coordinator,
    serve_fake,
)
from rlt_contracts import ConfigurationError
from rlt_contracts.pd import PDRole
from rlt_pd_coordinator import (
    CoordinationOptions,
    Coordinator,
    CoordinatorOptions,
    InstanceState,
)
from rlt_serve import LoopDefaults

KEY = "instance-key"


@contextlib.contextmanager
def pd_group(*, prefill=1, decode=1, replicas=0, engines=None, **options):
    """Fake instances (or the given FakeEngines) with a coordinator in front."""
    fakes = engines or (
        [FakeEngine("prefill", api_key=KEY) for _ in range(prefill)]
        + [FakeEngine("decode", api_key=KEY) for _ in range(decode)]
        + [FakeEngine("none", api_key=KEY) for _ in range(replicas)]
    )
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_fake(f)) for f in fakes]
        urls = {
            role: [s.url for s in servers if s.engine.role == role]
            for role in ("prefill", "decode", "none")
        }
        settings = dict(
            prefill_urls=tuple(urls["prefill"]),
            decode_urls=tuple(urls["decode"]),
            replica_urls=tuple(urls["none"]),
            mode="router" if urls["none"] else "pd",
            instance_api_key=KEY,
            log_level="warning",
            loop_defaults=LoopDefaults(min_loops=1, exit_threshold=0.5),
        )
        paced = {k: options.pop(k) for k in CoordinationOptions.__struct_fields__ if k in options}
        settings.update(
            options, coordination=CoordinationOptions(**{"poll_interval": 0.2, **paced})
        )
        coordinator = Coordinator(
            CoordinatorOptions(**settings), tokenizer=CharTokenizer(), model_info=FAKE_MODEL_INFO
        )
        running = stack.enter_context(serve_coordinator(coordinator))
        http = stack.enter_context(httpx.Client(base_url=running.url, timeout=20, trust_env=False))
        stack.callback(stop_all, running, servers)  # first: every server stops at once
        yield running, http, servers


def stop_all(running, servers) -> None:
    running.coordinator.server.should_exit = True
    for server in servers:
        server.server.should_exit = True


def sse_events(lines) -> list:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in lines
        if line.startswith("data: ")
    ]


def by_role(servers, role):
    return [s for s in servers if s.engine.role == role]


def complete(http, prompt="hello", **body):
    return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **body})


def wait_for(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def streamed(http, path, body):
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return sse_events(response.iter_lines())


# -- the happy path: the front over P and D ------------------------------------------------------
def test_completions_and_chat_stream_through_prefill_and_decode():
    with pd_group() as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        body = complete(http, return_token_ids=True).json()
        choice = body["choices"][0]
        assert choice["text"] == "Hi!?" and choice["token_ids"] == [72, 105, 33, 63]
        assert choice["exit_depths"] == [4, 2, 3, 1] and choice["finish_reason"] == "length"
        assert body["usage"]["loops"] == {
            "total_loops": 10,
            "mean_loops_per_token": 2.0,
            "model_depth": 4,
        }

        # D got the request with role decode and P's agent; P got D's target
        to_d, to_p = d.engine.requests[-1], p.engine.requests[-1]
        assert to_d.kv_transfer_params.role == "decode"
        assert to_d.kv_transfer_params.prefill_agent == p.engine.agent
        assert to_p.kv_transfer_params.role == "prefill"
        assert to_p.kv_transfer_params.target.decode_agent == d.engine.agent
        assert to_p.kv_transfer_params.transfer_id == to_d.kv_transfer_params.transfer_id
        assert to_d.request.prompt_token_ids == tuple(ord(c) for c in "hello")
        assert to_d.request.sampling.min_loops == 1  # the front's loop defaults

        events = streamed(http, "/v1/completions", {"prompt": "hey", "max_tokens": 3})
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == "Hi!"
        assert [d for c in chunks for d in c["exit_depths"]] == [4, 2, 3]

        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ).json()
        assert chat["choices"][0]["message"]["content"] == "Hi"
        assert chat["choices"][0]["exit_depths"] == [4, 2]
        events = streamed(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_loops": 3},
        )
        deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
        assert "".join(c["delta"].get("content") or "" for c in deltas) == "Hi!?"
        assert [x for c in deltas for x in c["exit_depths"]] == [4, 2, 3, 1]
        assert d.engine.requests[-1].request.sampling.max_loops == 3

        # every handoff completed on both sides and nothing is held
        wait_for(lambda: not p.engine.held and not d.engine.held, what="instances idle")
        assert len(p.engine.completed) == len(d.engine.completed) == 4
        assert http.get("/health").json() == {"status": "ok", "detail": None}
        # each instance was connected to the other's transport metadata
        assert d.engine.peers == {p.engine.agent: p.url}
        assert p.engine.peers == {d.engine.agent: d.url}
        metrics = http.get("/metrics").text
        assert "rlt:generation_tokens_total" in metrics


def test_decode_validation_error_is_the_engines_own_400():
    with pd_group() as (running, http, servers):
        (d,) = by_role(servers, "decode")
        d.engine.behaviour.decode_failure = "reject"
        response = complete(http, "x" * 9)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
        assert error["message"] == "prompt: the prompt is 9 tokens, too long here"
        d.engine.behaviour.decode_failure = None
        assert complete(http).status_code == 200


# -- routing and credits -------------------------------------------------------------------------
def test_routing_picks_the_least_loaded_instances():
    with pd_group(prefill=2, decode=2) as (running, http, servers):
        p0, p1 = by_role(servers, "prefill")
        d0, d1 = by_role(servers, "decode")
        d0.engine.behaviour.extra_running = 5  # d0 reports more work
        p1.engine.behaviour.extra_waiting = 3
        cluster = running.coordinator.cluster
        wait_for(
            lambda: (
                cluster.instances[2].load.running == 5 and cluster.instances[1].load.waiting == 3
            ),
            what="polled load",
        )
        for _ in range(3):
            assert complete(http).status_code == 200
            # (P may report `done` just after D's last token: wait for its credit)
            wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="idle")
        assert len(d1.engine.requests) == 3 and not d0.engine.requests
        assert len(p0.engine.requests) == 3 and not p1.engine.requests

        # with equal reported load, requests in flight count first: two slow requests at once
        # go to different decode instances
        d0.engine.behaviour.extra_running = 0
        p1.engine.behaviour.extra_waiting = 0
        wait_for(lambda: all(not i.load.waiting + i.load.running for i in cluster.instances))
        for fake in (d0, d1):
            fake.engine.behaviour.token_delay = 0.1
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(complete(http).status_code))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [200, 200]
        assert len(d0.engine.requests) == 1 and len(d1.engine.requests) == 4


def test_credits_limit_requests_in_flight_per_instance():
    with pd_group(decode_credits=1, credit_wait=0.0) as (running, http, servers):
        (d,) = by_role(servers, "decode")
        d.engine.behaviour.token_delay = 0.3
        first = threading.Thread(target=lambda: complete(http))
        first.start()
        cluster = running.coordinator.cluster
        wait_for(lambda: cluster.of_role(PDRole.DECODE)[0].in_flight == 1, what="in flight")
        second = complete(http)
        assert second.status_code == 429 and second.json()["error"]["code"] == "overloaded"
        assert "decode-0: 1/1" in second.json()["error"]["message"]
        d.engine.behaviour.token_delay = 0
        first.join()
        assert complete(http).status_code == 200
        wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="credits back")


# -- failures ------------------------------------------------------------------------------------
def test_prefill_error_is_a_clean_http_error_and_decode_frees():
    with pd_group() as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        p.engine.behaviour.prefill_failure = "error"
        response = complete(http)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "internal_error"
        assert "prefill instance prefill-0" in error["message"]
        assert "simulated KV write failure (code transfer_failed)" in error["message"]
        # D's connection was closed: it aborted the request and holds nothing
        wait_for(lambda: not d.engine.held, what="D freed")
        assert d.engine.closed_early == [d.engine.requests[-1].kv_transfer_params.transfer_id]

        events = streamed(http, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert events[-1] == "[DONE]" and "simulated KV write failure" in json.dumps(events)

        p.engine.behaviour.prefill_failure = None
        assert complete(http).json()["choices"][0]["text"] == "Hi!?"
        cluster = running.coordinator.cluster
        wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="credits back")


def test_prefill_dying_mid_transfer_fails_the_request_and_the_next_uses_the_survivor():
    engines = [FakeEngine(role, api_key=KEY) for role in ("prefill", "prefill", "decode")]
    p0, p1, d = engines
    p0.behaviour.prefill_failure = "drop"  # its connection breaks mid-transfer
    p1.behaviour.extra_waiting = 1  # so p0 is picked first
    with pd_group(engines=engines, poll_interval=30) as (running, http, servers):
        cluster = running.coordinator.cluster
        start = time.monotonic()
        response = complete(http)
        assert time.monotonic() - start < 3
        # a lost instance is the engine's unavailability (503), not a failure on the request
        assert response.status_code == 503
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
        assert "lost the connection to prefill instance prefill-0" in error["message"]
        wait_for(lambda: not d.held, what="D freed")
        assert d.closed_early == [d.requests[-1].kv_transfer_params.transfer_id]
        # the broken instance is routed around at once
        assert cluster.instances[0].state is InstanceState.UNREACHABLE
        assert complete(http).status_code == 200
        assert len(p1.requests) == 1
        # it answers polls again: back in the pool
        running.call(lambda: cluster.poll(cluster.instances[0]))
        assert cluster.instances[0].state is InstanceState.READY


def test_a_hung_prefill_times_out_and_both_connections_close():
    with pd_group(admission_timeout=5, transfer_timeout=0.5) as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        p.engine.behaviour.prefill_failure = "hang"
        start = time.monotonic()
        response = complete(http)
        assert 0.4 < time.monotonic() - start < 3
        assert response.status_code == 500
        assert (
            "did not complete within 0.5 s (waiting for P's transfer)"
            in (response.json()["error"]["message"])
        )
        wait_for(lambda: not p.engine.held and not d.engine.held, what="both freed")
        transfer = d.engine.requests[-1].kv_transfer_params.transfer_id
        assert p.engine.closed_early == [transfer] and d.engine.closed_early == [transfer]


def test_a_handoff_slower_than_the_http_read_timeout_completes_and_nobody_is_unreachable():
    """D's stream is silent from its target until token 0, P's until its writes are done: the
    admission and transfer timeouts bound those waits, not the HTTP client's read timeout
    (for the info / models / connect calls). A handoff longer than it failed with "lost the
    connection" and marked both healthy instances unreachable."""
    with pd_group(admission_timeout=5, transfer_timeout=5) as (running, http, servers):
        (p,) = by_role(servers, "prefill")
        cluster = running.coordinator.client.cluster
        cluster.http.timeout = httpx.Timeout(connect=5, read=0.2, write=5, pool=None)
        p.engine.behaviour.prefill_delay = 0.8
        response = complete(http)
        assert response.status_code == 200, response.text
        assert [i.state for i in cluster.instances] == [InstanceState.READY] * 2


def test_decode_that_never_admits_times_out():
    with pd_group(admission_timeout=0.4, transfer_timeout=5) as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        d.engine.behaviour.decode_failure = "never_admit"
        response = complete(http)
        assert response.status_code == 500
        assert "did not admit the request within 0.4 s" in response.json()["error"]["message"]
        assert not p.engine.requests  # P was never asked
        wait_for(lambda: not d.engine.held, what="D freed")


def test_dead_decode_fails_its_request_cleanly_and_the_survivor_serves_the_next():
    with pd_group(decode=2) as (running, http, servers):
        d0, d1 = by_role(servers, "decode")
        d1.engine.behaviour.extra_running = 1  # d0 first
        cluster = running.coordinator.cluster
        wait_for(lambda: cluster.instances[2].load.running == 1, what="polled load")
        d0.engine.behaviour.token_delay = 0.2
        lines = []
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(lines) == 1:
                    d0.kill()  # mid-decode, after its first token
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["text"] == "H"  # tokens before the failure arrived
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
        assert "lost the connection to decode instance decode-0" in error["message"]
        # the stream's one choice ended before the error event
        assert events[-3]["choices"][0]["finish_reason"] == "abort"
        assert http.get("/health").status_code == 200  # one lost instance: the service serves
        assert cluster.instances[1].state is InstanceState.UNREACHABLE
        for _ in range(2):
            assert complete(http).status_code == 200
        assert len(d1.engine.requests) == 2
        wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="credits back")


def test_decode_dead_before_the_request_is_skipped_transparently():
    with pd_group(decode=2, poll_interval=30) as (running, http, servers):
        d0, d1 = by_role(servers, "decode")
        d0.kill()  # no poll will notice before the request does
        cluster = running.coordinator.cluster
        assert cluster.instances[1].state is InstanceState.READY
        for _ in range(3):
            assert complete(http).status_code == 200
        assert cluster.instances[1].state is InstanceState.UNREACHABLE
        assert len(d1.engine.requests) == 3

        d1.kill()
        response = complete(http)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_unavailable"
        assert "no decode instance is available" in response.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "no decode instance" in health.json()["detail"]


# -- compatibility at connect --------------------------------------------------------------------
def test_incompatible_instances_are_refused_at_connect_naming_the_field():
    import msgspec

    other = msgspec.structs.replace(DEFAULT_COMPATIBILITY, block_size=32)
    engines = [FakeEngine("prefill", api_key=KEY), FakeEngine("decode", compatibility=other)]
    engines[1].api_key = KEY
    with pytest.raises(ConfigurationError) as refused:
        with pd_group(engines=engines):
            pass
    message = str(refused.value)
    assert "block_size 16 on prefill-0, 32 on decode-0" in message
    assert not engines[0].connect_calls and not engines[1].connect_calls

    # the instances' own check (409 pd_incompatible), when info does not show the difference
    engines = [
        FakeEngine("prefill", api_key=KEY),
        FakeEngine(
            "decode", api_key=KEY, compatibility=other, info_compatibility=DEFAULT_COMPATIBILITY
        ),
    ]
    with pytest.raises(ConfigurationError) as refused:
        with pd_group(engines=engines):
            pass
    message = str(refused.value)
    assert "refused to connect: incompatible peer" in message
    assert "block_size: 16 here, 32 there" in message or "block_size: 32 here, 16 there" in message


def test_a_role_mismatch_is_refused():
    engines = [FakeEngine("decode", api_key=KEY), FakeEngine("decode", api_key=KEY)]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_fake(e)) for e in engines]
        options = CoordinatorOptions(
            prefill_urls=(servers[0].url,), decode_urls=(servers[1].url,), instance_api_key=KEY
        )
        coordinator = Coordinator(options, tokenizer=CharTokenizer(), model_info=FAKE_MODEL_INFO)
        with pytest.raises(ConfigurationError, match="reports role decode"):
            with serve_coordinator(coordinator):
                pass


# -- the plain router ----------------------------------------------------------------------------
def test_router_mode_balances_over_replicas():
    with pd_group(prefill=0, decode=0, replicas=2) as (running, http, servers):
        r0, r1 = servers
        for _ in range(4):
            body = complete(http).json()
            assert body["choices"][0]["exit_depths"] == [4, 2, 3, 1]
        assert len(r0.engine.requests) == len(r1.engine.requests) == 2
        assert all(b.kv_transfer_params.role == "none" for b in r0.engine.requests)

        for fake in servers:
            fake.engine.behaviour.token_delay = 0.1
        threads = [threading.Thread(target=lambda: complete(http)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(r0.engine.requests) == len(r1.engine.requests) == 4
        events = streamed(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert [x for e in events[:-1] for c in e["choices"] for x in c["exit_depths"]] == [4, 2]


# -- cancellation --------------------------------------------------------------------------------
def test_client_disconnect_closes_both_connections():
    with pd_group() as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        # disconnect while P is still "transferring": both instances see their connection end
        p.engine.behaviour.prefill_failure = "hang"
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as response:
            assert response.status_code == 200
            wait_for(lambda: p.engine.held and d.engine.held, what="transfer under way")
        wait_for(lambda: not p.engine.held and not d.engine.held, what="both freed")
        transfer = d.engine.requests[-1].kv_transfer_params.transfer_id
        assert p.engine.closed_early == [transfer] and d.engine.closed_early == [transfer]

        # disconnect while D decodes
        p.engine.behaviour.prefill_failure = None
        d.engine.behaviour.token_delay = 0.3
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as response:
            next(response.iter_lines())
        wait_for(lambda: not d.engine.held, what="D freed")
        assert d.engine.closed_early[-1] == d.engine.requests[-1].kv_transfer_params.transfer_id
        cluster = running.coordinator.cluster
        wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="credits back")


def test_cancel_through_the_engine_client_closes_both_connections():
    import asyncio

    from rlt_contracts import EngineRequest, SamplingParams

    with pd_group() as (running, http, servers):
        (p,), (d,) = by_role(servers, "prefill"), by_role(servers, "decode")
        p.engine.behaviour.prefill_failure = "hang"
        client = running.coordinator.client

        async def submit_then_cancel():
            request = EngineRequest("r-1", (1, 2, 3), SamplingParams(max_tokens=2))
            await client.submit(request)
            stream = client.stream("r-1")
            while not p.engine.held:
                await asyncio.sleep(0.01)
            await client.cancel("r-1")
            return [delta async for delta in stream]

        deltas = running.call(submit_then_cancel)
        assert len(deltas) == 1 and deltas[0].finished
        assert deltas[0].finish_reason == "abort" and deltas[0].error is None
        wait_for(lambda: p.engine.closed_early and d.engine.closed_early, what="both closed")
        assert not p.engine.held and not d.engine.held


def test_a_cancel_right_after_submit_closes_both_connections_and_returns_the_credits():
    """The front end cancels as soon as submit returns when the client left during the
    submission: the request's task has not run yet. It must still close D's connection (D
    aborts) and return the credits; a task cancelled before it first ran never entered its
    cleanup, and D held the request until its KV wait timed out."""
    from rlt_contracts import EngineRequest, SamplingParams

    with pd_group() as (running, http, servers):
        (d,) = by_role(servers, "decode")
        client = running.coordinator.client

        async def submit_then_cancel_at_once():
            request = EngineRequest("r-2", (1, 2, 3), SamplingParams(max_tokens=2))
            await client.submit(request)
            await client.cancel("r-2")  # no await in between: the task has not started

        running.call(submit_then_cancel_at_once)
        wait_for(lambda: d.engine.closed_early, what="D's connection closed")
        assert not d.engine.held
        cluster = running.coordinator.cluster
        wait_for(lambda: all(i.in_flight == 0 for i in cluster.instances), what="credits back")
        # the id is free again and serves normally
        events = streamed(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert events[-1] == "[DONE]"
