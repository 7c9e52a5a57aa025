"""Odd input over real HTTP: text that is not valid Unicode, explicit nulls, context overflow.

- A lone UTF-16 surrogate ("\\ud800" in the JSON) in any string field answers 400 naming the
  field, on the same keep-alive connection, which then serves the next request.
- An unexpected error (a bug) answers a JSON 500 and the connection stays usable too.
- `null` for an option means its default, from plain HTTP and from the official openai
  client (which sends null for options given as None).
- Context overflow answers 400 with `code: context_length_exceeded`.
"""

from __future__ import annotations

import json
from http.client import HTTPConnection

import httpx2
import pytest
from serving_harness import run_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


def post_raw(connection: HTTPConnection, path: str, body: bytes):
    """POST raw JSON bytes on `connection`; (status, JSON body)."""
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


CHAT = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
SURROGATE_CASES = [
    # (path, raw JSON body, param)
    ("/v1/completions", rb'{"prompt": "It \ud800 is", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "x\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", rb'{"prompt": "ok", "max_tokens": 2, "stop": ["\ud800"]}', "stop[0]"),
    ("/v1/completions", rb'{"prompt": "ok", "model": "\ud800"}', "model"),
    (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        ("{" + CHAT + r', "chat_template_kwargs": {"x": "\ud800"}}').encode(),
        "chat_template_kwargs.x",
    ),
    (
        "/v1/chat/completions",
        ("{" + CHAT + r', "stream": true, "user": "\ud800"}').encode(),
        "user",
    ),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
]


def test_lone_surrogates_answer_400_naming_the_field_on_a_connection_that_stays_usable(server):
    connection = HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.connect()
    socket = connection.sock
    try:
        for path, body, param in SURROGATE_CASES:
            status, answer = post_raw(connection, path, body)
            assert status == 400, (body, answer)
            assert answer["error"]["param"] == param, (body, answer)
            assert "surrogate" in answer["error"]["message"]
            assert connection.sock is socket, f"the server closed the connection after {body}"
        # An unknown field whose name holds a surrogate: still a JSON 400 (the name escaped).
        status, answer = post_raw(connection, "/v1/completions", rb'{"prompt": "ok", "\ud800": 1}')
        assert status == 400 and answer["error"]["param"] == "\\ud800"
        status, answer = post_raw(
            connection,
            "/v1/completions",
            b'{"prompt": "It is", "max_tokens": 2, "ignore_eos": true}',
        )
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert connection.sock is socket
    finally:
        connection.close()
    server.wait_idle()


class _FailingDecode:
    """A tokenizer whose decode fails: stands in for a bug reached while answering."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, *args, **kwargs):
        raise RuntimeError("simulated bug")


def test_an_unexpected_error_answers_json_500_and_the_connection_stays_usable(server):
    ctx = server.app.state.rlt
    tokenizer = ctx.tokenizer
    connection = HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.connect()
    socket = connection.sock
    ctx.tokenizer = _FailingDecode(tokenizer)
    try:
        body = b'{"prompt": "It is", "max_tokens": 2, "logprobs": 1}'
        status, answer = post_raw(connection, "/v1/completions", body)
        assert status == 500, answer
        assert answer["error"]["type"] == "internal_error"
        assert "RuntimeError" in answer["error"]["message"]
        assert connection.sock is socket
    finally:
        ctx.tokenizer = tokenizer
    try:
        status, answer = post_raw(connection, "/v1/completions", body)
        assert status == 200 and len(answer["choices"][0]["logprobs"]["tokens"]) == 2
        assert connection.sock is socket
    finally:
        connection.close()
    server.wait_idle()


NULL_OPTIONS = {
    "temperature": None,
    "top_p": None,
    "n": None,
    "stream": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "top_k": None,
    "priority": None,
    "ignore_eos": None,
    "stream_options": None,
}


def test_null_options_mean_their_defaults(http):
    base = {"prompt": "It is", "seed": 11, "return_token_ids": True}
    plain = http.post("/v1/completions", json=base)
    nulls = http.post("/v1/completions", json={**base, **NULL_OPTIONS, "max_tokens": None})
    assert plain.status_code == 200 and nulls.status_code == 200, nulls.text
    plain_choice, null_choice = plain.json()["choices"][0], nulls.json()["choices"][0]
    assert null_choice["token_ids"] == plain_choice["token_ids"]  # same seed, same defaults
    assert null_choice["text"] == plain_choice["text"]
    assert len(null_choice["token_ids"]) == 16 or null_choice["finish_reason"] == "stop"

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 5}
    plain = http.post("/v1/chat/completions", json=chat)
    nulls = http.post(
        "/v1/chat/completions",
        json={**chat, **NULL_OPTIONS, "logprobs": None, "top_logprobs": None, "echo": None},
    )
    assert plain.status_code == 200 and nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert nulls.json()["choices"][0]["logprobs"] is None


def test_the_openai_client_may_send_null_options(server):
    sent: list[dict] = []

    def record(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    client = server.openai(event_hooks={"request": [record]})
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert sent[-1]["temperature"] is None and sent[-1]["logprobs"] is None  # nulls were sent
    completion = client.completions.create(
        model="tiny", prompt="It is", max_tokens=None, temperature=None, n=None, top_p=None
    )
    assert sent[-1]["max_tokens"] is None
    assert completion.usage.completion_tokens <= 16


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [7] * 600}, "prompt"),
        ("/v1/completions", {"prompt": [7] * 500, "max_tokens": 20}, "max_tokens"),
        ("/v1/completions", {"prompt": [[5], [7] * 600]}, "prompt[1]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 700}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600},
            "max_completion_tokens",
        ),
    ],
)
def test_context_overflow_has_code_context_length_exceeded(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
