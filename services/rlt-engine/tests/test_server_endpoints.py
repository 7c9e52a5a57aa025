"""GET /v1/models/{model}, GET /version, POST /tokenize and POST /detokenize over real HTTP and
with the official openai client; the KV usage gauge in /metrics."""

from __future__ import annotations

import re
from importlib import metadata

import httpx2
import openai
import pytest
from serving_harness import run_server


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="org/tiny") as running:
        yield running


def test_retrieve_the_served_model(http, client):
    card = http.get("/v1/models/org/tiny")
    assert card.status_code == 200, card.text
    assert card.json() == http.get("/v1/models").json()["data"][0]
    assert client.models.retrieve("org/tiny").id == "org/tiny"
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_version_is_the_package_version(http, client, server):
    assert http.get("/version").json() == {"version": metadata.version("rlt")}
    answer = client.get(f"{server.base_url}/version", cast_to=httpx2.Response)
    assert answer.json()["version"] == metadata.version("rlt")


def test_tokenize_a_prompt_as_completions_do(http, client, server):
    answer = http.post("/tokenize", json={"model": "org/tiny", "prompt": "It is a truth"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    completion = http.post(
        "/v1/completions", json={"prompt": "It is a truth", "max_tokens": 1}
    ).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {
        "prompt": "It is a truth"
    }
    # the openai client's generic post reaches the same endpoints
    via_client = client.post(
        f"{server.base_url}/tokenize", body={"prompt": "It is a truth"}, cast_to=httpx2.Response
    )
    assert via_client.json()["tokens"] == body["tokens"]


def test_tokenize_messages_as_chat_does(http):
    messages = [{"role": "user", "content": "hi"}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    shorter = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert shorter["count"] < len(tokens)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [1, 320]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
        ("/detokenize", {}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            400,
            "messages",
        ),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_tokenizer_endpoints_need_the_api_key(checkpoint):
    with run_server(checkpoint, api_key="s3cret") as server, server.http() as http:
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert http.post("/detokenize", json={"tokens": [1]}).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert http.post("/tokenize", json={"prompt": "x"}, headers=key).status_code == 200
        assert http.get("/version").status_code == 200


def test_metrics_report_the_kv_cache_usage_fraction(http, server):
    text = http.get("/metrics").text
    match = re.search(r"^rlt:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    assert match is not None
    stats = server.client.stats()
    assert float(match.group(1)) == pytest.approx(stats.kv_blocks_used / stats.kv_blocks_total)
