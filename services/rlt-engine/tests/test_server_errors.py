"""Bad input, overload, auth, limits and engine failure over real HTTP.

Every bad input answers its 4xx with an OpenAI error body naming the field (never a 500), and
the server keeps answering afterwards; a full waiting queue answers 429 with Retry-After; the
API key is enforced on /v1/* only; bodies over the limit answer 413; foreign Host/Origin
headers answer 403; a dead engine turns /health to 503 and requests to 503 / in-band errors.
"""

from __future__ import annotations

import re
import time

import pytest
from in_flight_failures import assert_failed_stream
from serving_harness import run_server, sse_events


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny", max_body_bytes=4096) as running:
        yield running


# ignore_eos: it finishes with "length" whatever is sampled
OK_COMPLETION = {"prompt": "It is", "max_tokens": 2, "ignore_eos": True}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_COMPLETIONS = [
    # (body, status, param)
    ({**OK_COMPLETION, "max_tokens": -1}, 400, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": 10**12}, 400, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": "5"}, 400, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": 2.5}, 400, "max_tokens"),
    ({**OK_COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ({**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ({**OK_COMPLETION, "top_p": 0}, 400, "top_p"),
    ({**OK_COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ({**OK_COMPLETION, "top_k": -3}, 400, "top_k"),
    ({**OK_COMPLETION, "seed": -1}, 400, "seed"),
    ({**OK_COMPLETION, "stop": [""]}, 400, "stop"),
    ({**OK_COMPLETION, "stop": 7}, 400, "stop"),
    ({**OK_COMPLETION, "n": 0}, 400, "n"),
    ({**OK_COMPLETION, "n": 129}, 400, "n"),
    ({**OK_COMPLETION, "n": 3, "best_of": 2}, 400, "best_of"),
    ({**OK_COMPLETION, "best_of": 129}, 400, "best_of"),
    ({**OK_COMPLETION, "best_of": 2, "stream": True}, 400, "best_of"),
    ({**OK_COMPLETION, "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ({**OK_COMPLETION, "echo": "yes"}, 400, "echo"),
    ({**OK_COMPLETION, "stop_token_ids": [5, 320]}, 400, "stop_token_ids"),
    ({**OK_COMPLETION, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({**OK_COMPLETION, "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    ({**OK_COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({**OK_COMPLETION, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({**OK_COMPLETION, "suffix": "end"}, 400, "suffix"),
    ({**OK_COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ({**OK_COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**OK_COMPLETION, "min_loops": 0}, 400, "min_loops"),
    ({**OK_COMPLETION, "max_loops": 9}, 400, "max_loops"),
    ({**OK_COMPLETION, "min_loops": 3, "max_loops": 2}, 400, "max_loops"),
    ({**OK_COMPLETION, "exit_threshold": 1.5}, 400, "exit_threshold"),
    ({**OK_COMPLETION, "priority": "high"}, 400, "priority"),
    ({**OK_COMPLETION, "frobnicate": 1}, 400, "frobnicate"),
    ({**OK_COMPLETION, "prompt": ""}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": []}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": [[]]}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": ["ok", ""]}, 400, "prompt[1]"),
    ({**OK_COMPLETION, "prompt": [1, 320]}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": [1, -2]}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": 5}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": [1, "a"]}, 400, "prompt"),
    ({**OK_COMPLETION, "prompt": [7] * 600}, 400, "prompt"),  # longer than the 512 context
    ({**OK_COMPLETION, "prompt": [7] * 500, "max_tokens": 20}, 400, "max_tokens"),
    ({"max_tokens": 2}, 400, "prompt"),
    ({**OK_COMPLETION, "model": "gpt-4"}, 404, "model"),
]

BAD_CHATS = [
    ({**OK_CHAT, "messages": []}, 400, "messages"),
    ({**OK_CHAT, "messages": "hi"}, 400, "messages"),
    ({**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({**OK_CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({**OK_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ({**OK_CHAT, "max_tokens": None, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({**OK_CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ({**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({**OK_CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({**OK_CHAT, "n": 200}, 400, "n"),
    ({**OK_CHAT, "n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
    ({**OK_CHAT, "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output"),
    ({**OK_CHAT, "temperature": -1}, 400, "temperature"),
    ({**OK_CHAT, "top_p": 0}, 400, "top_p"),
    ({**OK_CHAT, "stop_token_ids": [320]}, 400, "stop_token_ids"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": "x" * 700}]}, 400, "messages"),
    ({**OK_CHAT, "model": "nope"}, 404, "model"),
    ({**OK_CHAT, "unknown_field": True}, 400, "unknown_field"),
]


def assert_error(response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    BAD_COMPLETIONS,
    ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_COMPLETIONS)],
)
def test_bad_completion_requests(http, body, status, param):
    assert_error(http.post("/v1/completions", json=body), status, param)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    BAD_CHATS,
    ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_CHATS)],
)
def test_bad_chat_requests(http, body, status, param):
    assert_error(http.post("/v1/chat/completions", json=body), status, param)


def test_bad_streaming_request_answers_before_the_stream_starts(http):
    response = http.post("/v1/completions", json={**OK_COMPLETION, "stream": True, "top_p": 7})
    assert_error(response, 400, "top_p")


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b'{"prompt": "x", ', "application/json", 400),  # malformed JSON
        (b"[1, 2]", "application/json", 400),  # not an object
        (b"", "application/json", 400),
        (b"prompt=x", "application/x-www-form-urlencoded", 415),
    ],
)
def test_malformed_bodies(http, content, content_type, status):
    response = http.post("/v1/completions", content=content, headers={"Content-Type": content_type})
    assert_error(response, status, None)


def test_json_without_a_content_type_is_accepted(http):
    response = http.post(
        "/v1/completions",
        content=b'{"prompt": "It is", "max_tokens": 2}',
        headers={"Content-Type": ""},
    )
    assert response.status_code == 200, response.text


def test_body_over_the_limit_answers_413(http):
    response = http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "x" * 5000})
    assert_error(response, 413, None)

    def chunked():  # no Content-Length: the limit still holds
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    response = http.post(
        "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, None)


def test_foreign_host_and_origin_headers_answer_403(http):
    assert_error(http.get("/v1/models", headers={"Host": "evil.example"}), 403, None)
    assert_error(
        http.post(
            "/v1/completions", json=OK_COMPLETION, headers={"Origin": "https://evil.example"}
        ),
        403,
        None,
    )
    assert http.get("/v1/models", headers={"Host": "localhost:1234"}).status_code == 200


def test_unknown_route_and_method_use_the_error_body(http):
    assert_error(http.get("/v1/nothing"), 404, None)
    assert_error(http.get("/v1/completions"), 405, None)


def test_the_server_keeps_answering_after_bad_input(http, server):
    for body, _, _ in BAD_COMPLETIONS[:5]:
        http.post("/v1/completions", json=body)
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json=OK_COMPLETION)
    assert (
        response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    )
    chat = http.post("/v1/chat/completions", json=OK_CHAT)
    assert chat.status_code == 200
    assert server.client.dead is None
    server.wait_idle()


def test_full_waiting_queue_answers_429(checkpoint):
    engine = dict(
        max_num_seqs=1, max_waiting_requests=1, max_num_batched_tokens=16, prefill_chunk_size=8
    )
    with run_server(checkpoint, engine=engine) as server, server.http() as http:
        long = {"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # (keep it: a dropped iterator closes the response)
            next(lines)  # the first request holds the only running slot now
            with http.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                deadline = time.monotonic() + 10
                while server.client.stats().waiting_requests < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert_error(response, 429, None)
                assert response.headers["Retry-After"] == "1"
                assert response.json()["error"]["code"] == "overloaded"
                chat = http.post("/v1/chat/completions", json=OK_CHAT)
                assert chat.status_code == 429
        server.wait_idle()
        assert (
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        )


def test_api_key_is_enforced_on_v1_only(checkpoint):
    with run_server(checkpoint, api_key="s3cret") as server, server.http() as http:
        assert_error(http.get("/v1/models"), 401, None)
        assert_error(http.post("/v1/completions", json=OK_COMPLETION), 401, None)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(http.post("/v1/completions", json=OK_COMPLETION, headers=wrong), 401, None)
        # auth is checked before the body: a bad body without the key is still a 401
        assert_error(
            http.post(
                "/v1/completions", content=b"{", headers={"Content-Type": "application/json"}
            ),
            401,
            None,
        )
        good = {"Authorization": "Bearer s3cret"}
        assert http.get("/v1/models", headers=good).status_code == 200
        assert http.post("/v1/completions", json=OK_COMPLETION, headers=good).status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        schema = http.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]


def test_dead_engine_turns_health_503_and_fails_requests_cleanly(checkpoint):
    with run_server(checkpoint, check_leaks=False) as server, server.http() as http:
        engine = server.engine
        real_step = engine.core.step
        armed = []

        def step():
            if armed:
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.core.step = step  # read by the engine thread on its next step
        assert http.post("/v1/completions", json=OK_COMPLETION).status_code == 200
        armed.append(True)
        response = http.post("/v1/completions", json={**OK_COMPLETION, "stream": True})
        assert response.status_code == 200
        events = sse_events(response.text.splitlines())
        assert "simulated device failure" in events[-2]["error"]["message"]
        assert events[-1] == "[DONE]"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert_error(http.post("/v1/completions", json=OK_COMPLETION), 503, None)
        assert http.get("/metrics").status_code == 200
        assert re.search(r"^rlt:engine_up\{[^}]*\} 0\.0$", http.get("/metrics").text, re.M)


class _BuggyDecode:
    """A tokenizer whose decode fails while armed: stands in for a bug in the output path."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.armed = True

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, *args, **kwargs):
        if self.armed:
            raise RuntimeError("simulated bug in the output path")
        return self._tokenizer.decode(*args, **kwargs)


def stream_events(http, path: str, body: dict) -> list:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    return sse_events(response.text.splitlines())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bug_building_a_chunk_ends_the_stream_with_the_error_event(server, path):
    """The chunk builder raises (logprobs' token text): every choice ends (finish_reason
    "abort"), the usage chunk, a 500 error event and [DONE] go out, the engine requests are
    cancelled, and the server serves on."""
    ctx = server.app.state.rlt
    tokenizer = ctx.tokenizer
    ctx.tokenizer = _BuggyDecode(tokenizer)
    chat = path.endswith("chat/completions")
    body = OK_CHAT if chat else OK_COMPLETION
    body = {**body, "max_tokens": 200, "ignore_eos": True, "n": 2}
    body |= {"logprobs": True} if chat else {"logprobs": 1}
    body |= {"stream_options": {"include_usage": True}}
    try:
        with server.http() as http:
            events = stream_events(http, path, body)
            ended = assert_failed_stream(events, choices=2, error=("internal_error", None))
            assert "RuntimeError" in ended["message"]
            server.wait_idle()  # both engine requests were cancelled: their KV is free
            ctx.tokenizer = tokenizer
            del body["stream_options"]
            response = http.post(path, json={**body, "max_tokens": 3})
            assert response.status_code == 200
            # (a chat may stop on its template's end-of-turn token)
            assert {c["finish_reason"] for c in response.json()["choices"]} <= {"length", "stop"}
    finally:
        ctx.tokenizer = tokenizer
    server.wait_idle()


class _BuggyDetokenizer:
    """A request's detokenizer that fails on its first tokens: a bug in the output processor."""

    def __init__(self, detokenizer) -> None:
        self._detokenizer = detokenizer

    def __getattr__(self, name):
        return getattr(self._detokenizer, name)

    def add_tokens(self, *args, **kwargs):
        raise RuntimeError("simulated bug in the output processor")


def test_a_bug_processing_the_engines_output_fails_only_its_requests(server, monkeypatch):
    """Detokenizing a request's tokens raises (in the front end's output processor): that
    request's stream ends with a 500 error event and [DONE], a non-streaming one answers a 500
    JSON body, both are aborted in the engine (KV freed), and the server serves on."""
    processor = server.client._processor  # the front end's output processor (one per client)
    detokenizer = processor._detokenizer
    monkeypatch.setattr(processor, "_detokenizer", lambda r: _BuggyDetokenizer(detokenizer(r)))
    with server.http() as http:
        body = {**OK_COMPLETION, "max_tokens": 200, "n": 2}
        body |= {"stream_options": {"include_usage": True}}
        events = stream_events(http, "/v1/completions", body)
        ended = assert_failed_stream(events, choices=2, error=("internal_error", None))
        assert "RuntimeError" in ended["message"]
        response = http.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 200})
        assert_error(response, 500, None)
        assert response.json()["error"]["type"] == "internal_error"
        server.wait_idle()
        assert not server.client._streams  # nothing of the failed requests is kept
        monkeypatch.undo()
        assert http.post("/v1/completions", json=OK_COMPLETION).status_code == 200
    server.wait_idle()
