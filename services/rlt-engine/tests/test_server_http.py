"""The real HTTP server (uvicorn on 127.0.0.1, a free port) over a tiny model.

Covered: completions and chat, non-streaming and streaming, equal to LLM.generate for the same
greedy requests (token ids, exit depths, text); the official openai client; many concurrent
streams; a client disconnecting mid-stream aborts its request and frees every KV block;
/metrics parses as Prometheus text and its counters move; /v1/models, /health; the OpenAPI
schema describes the request and response bodies with the rlt extension fields.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import pytest
from rlt import LLM, SamplingParams
from serving_harness import ENGINE_DEFAULTS, metric_samples, run_server, sse_events

LOOPS = dict(exit_threshold=0.8, min_loops=2)  # adaptive exit: depths vary per token


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(checkpoint, **ENGINE_DEFAULTS)


def expected(reference, prompt, **params):
    return reference.generate([prompt], SamplingParams(**{**LOOPS, **params}))[0]


def completion_body(prompt, **fields):
    return {
        "model": "tiny",
        "prompt": prompt,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **LOOPS,
        **fields,
    }


def test_non_streaming_completion_equals_generate(http, reference):
    for prompt in ["It is a truth", [5, 17, 200, 3, 99, 42, 7]]:
        want = expected(reference, prompt, max_tokens=10, ignore_eos=True)
        response = http.post("/v1/completions", json=completion_body(prompt, max_tokens=10))
        assert response.status_code == 200, response.text
        body = response.json()
        [choice] = body["choices"]
        assert choice["token_ids"] == want.token_ids
        assert choice["exit_depths"] == want.exit_depths
        assert choice["text"] == want.text
        assert choice["finish_reason"] == "length"
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
        assert usage["completion_tokens"] == 10
        assert usage["total_tokens"] == usage["prompt_tokens"] + 10
        assert usage["loops"]["total_loops"] == sum(want.exit_depths)
        assert usage["loops"]["mean_loops_per_token"] == pytest.approx(want.mean_loops)
        assert usage["loops"]["model_depth"] == 4


def test_several_prompts_give_one_choice_each(http, reference):
    prompts = ["The morning train", "A baker carried"]
    response = http.post("/v1/completions", json=completion_body(prompts, max_tokens=6))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    wants = [expected(reference, prompt, max_tokens=6, ignore_eos=True) for prompt in prompts]
    for want, choice in zip(wants, choices, strict=True):
        assert choice["token_ids"] == want.token_ids and choice["exit_depths"] == want.exit_depths
    assert response.json()["usage"]["completion_tokens"] == 12

    token_prompts = [[5, 6, 7], [8, 9]]  # a list of token-id lists, streamed
    body = completion_body(token_prompts, max_tokens=5, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as streamed:
        events = sse_events(streamed.iter_lines())
    assert events[-1] == "[DONE]"
    for index, prompt in enumerate(token_prompts):
        want = expected(reference, prompt, max_tokens=5, ignore_eos=True)
        mine = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == index]
        assert [t for c in mine for t in c["token_ids"]] == want.token_ids
        assert mine[-1]["finish_reason"] == "length"


def test_streaming_completion_equals_generate(http, reference):
    want = expected(reference, "It is a truth", max_tokens=12, ignore_eos=True, logprobs=2)
    body = completion_body(
        "It is a truth",
        max_tokens=12,
        stream=True,
        logprobs=2,
        stream_options={"include_usage": True},
    )
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    depths = [d for c in chunks for d in c["choices"][0]["exit_depths"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert (tokens, depths, text) == (want.token_ids, want.exit_depths, want.text)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    logprobs = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert logprobs == pytest.approx(want.logprobs, abs=1e-5)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(len(top) <= 2 for c in chunks for top in c["choices"][0]["logprobs"]["top_logprobs"])


def chat_reference(reference, server, messages, **params):
    tokenizer = reference.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return expected(reference, prompt, stop_token_ids=(im_end,), **params)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where are we going?"},
]


def test_chat_completion_equals_generate(http, reference, server):
    want = chat_reference(reference, server, MESSAGES, max_tokens=9, logprobs=1)
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 9,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 1,
        **LOOPS,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    [choice] = result["choices"]
    assert result["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["token_ids"] == want.token_ids and choice["exit_depths"] == want.exit_depths
    assert choice["finish_reason"] == str(want.finish_reason)
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(c["top_logprobs"]) == 1 for c in content)
    assert result["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_streaming_chat_equals_generate(http, reference, server):
    want = chat_reference(reference, server, MESSAGES, max_tokens=9)
    body = {
        "messages": MESSAGES,
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        **LOOPS,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert tokens == want.token_ids and text == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == str(want.finish_reason)


def test_official_openai_client(server, reference):
    client = server.openai()
    extra = {"ignore_eos": True, **LOOPS}
    want = expected(reference, "It is a truth", max_tokens=8, ignore_eos=True)
    completion = client.completions.create(
        model="tiny", prompt="It is a truth", max_tokens=8, temperature=0, extra_body=extra
    )
    assert completion.choices[0].text == want.text
    assert completion.choices[0].model_extra["exit_depths"] == want.exit_depths
    assert completion.usage.completion_tokens == 8
    stream = client.completions.create(
        model="tiny",
        prompt="It is a truth",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == want.text

    chat_want = chat_reference(reference, server, MESSAGES, max_tokens=6)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, extra_body=LOOPS
    )
    assert chat.choices[0].message.content == chat_want.text
    assert chat.choices[0].model_extra["exit_depths"] == chat_want.exit_depths
    chat_stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LOOPS,
    )
    chunks = list(chat_stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_want.text
    assert chunks[-1].usage.completion_tokens == len(chat_want.token_ids)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_many_concurrent_streams_complete_correctly(server, reference):
    prompts = [[5 + i, 17, 200 - i, 3, 99, 42][: 2 + i % 5] for i in range(8)]
    lengths = [6 + i % 4 for i in range(8)]
    wants = reference.generate(
        prompts, [SamplingParams(max_tokens=n, ignore_eos=True, **LOOPS) for n in lengths]
    )

    async def one(client: httpx2.AsyncClient, prompt, n):
        body = completion_body(prompt, max_tokens=n, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            return sse_events([line async for line in response.aiter_lines()])

    async def main():
        async with httpx2.AsyncClient(
            base_url=server.base_url, trust_env=False, timeout=60
        ) as client:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )

    started = server.client.stats().finished_requests
    results = asyncio.run(main())
    for events, want in zip(results, wants, strict=True):
        assert events[-1] == "[DONE]"
        tokens = [t for c in events[:-1] for t in c["choices"][0]["token_ids"]]
        depths = [d for c in events[:-1] for d in c["choices"][0]["exit_depths"]]
        assert tokens == want.token_ids and depths == want.exit_depths
    assert server.client.stats().finished_requests - started == 8
    server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_every_kv_block(server, http):
    before = metric_values(http)
    aborted_before = server.client.stats().aborted_requests
    with httpx2.Client(base_url=server.base_url, trust_env=False, timeout=30) as client:
        body = completion_body([1, 2, 3, 4, 5], max_tokens=400, stream=True)
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = 0
            for line in lines:
                received += line.startswith("data: ")
                if received == 3:
                    break
            assert server.client.stats().kv_blocks_used > 0
        # leaving the block closes the connection mid-stream
    stats = server.wait_idle(timeout=10)
    assert stats.aborted_requests == aborted_before + 1
    assert stats.kv_blocks_used == 0
    key = ("rlt:http_requests_total", (("endpoint", "completions"), ("outcome", "abort")))
    after = wait_for_metric(http, key, before)
    assert after > before.get(key, 0)


def test_disconnect_of_a_non_streaming_request_aborts_it(server):
    aborted_before = server.client.stats().aborted_requests

    async def main():
        async with httpx2.AsyncClient(base_url=server.base_url, trust_env=False) as client:
            request = asyncio.create_task(
                client.post("/v1/completions", json=completion_body([9, 9, 9], max_tokens=400))
            )
            deadline = time.monotonic() + 10
            while server.client.stats().running_requests == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(main())
    stats = server.wait_idle(timeout=10)
    assert stats.aborted_requests == aborted_before + 1


def metric_values(http) -> dict:
    """{(sample name, sorted labels other than model_name): value} of one scrape."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for name, labels, value in metric_samples(response.text):
        labels.pop("model_name", None)
        values[(name, tuple(sorted(labels.items())))] = value
    return values


def wait_for_metric(http, key, before, timeout=5.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric_values(http).get(key, 0)
        if value > before.get(key, 0) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def test_metrics_parse_and_counters_move(http):
    before = metric_values(http)
    response = http.post("/v1/completions", json=completion_body("It is a truth", max_tokens=5))
    assert response.status_code == 200
    bad = http.post("/v1/completions", json=completion_body("x", max_tokens=0))
    assert bad.status_code == 400
    after = metric_values(http)

    def moved(name, labels=()):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0) - before.get(key, 0)

    http_requests = "rlt:http_requests_total"
    assert moved(http_requests, [("endpoint", "completions"), ("outcome", "length")]) == 1
    assert moved(http_requests, [("endpoint", "completions"), ("outcome", "invalid")]) == 1
    assert moved("rlt:request_success_total", [("finished_reason", "length")]) == 1
    assert moved("rlt:generation_tokens_total") == 5
    assert moved("rlt:prompt_tokens_total") > 0
    assert moved("rlt:engine_steps_total") > 0
    assert moved("rlt:time_to_first_token_seconds_count") == 1
    assert moved("rlt:inter_token_latency_seconds_count") == 4
    assert moved("rlt:loops_per_token_count") == 4  # decoded tokens (token 0 is prefill)
    assert moved("rlt:e2e_request_latency_seconds_count") == 1
    for gauge in (
        "rlt:num_requests_running",
        "rlt:num_requests_waiting",
        "rlt:kv_cache_usage_perc",
        "rlt:kv_cache_blocks_used",
        "rlt:kv_cache_blocks_free",
        "rlt:kv_cache_blocks_total",
    ):
        assert (gauge, ()) in after
    assert after[("rlt:kv_cache_blocks_total", ())] == 512
    assert after[("rlt:engine_up", ())] == 1


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == "tiny" and card["object"] == "model"
    assert card["max_model_len"] == 512 and card["num_loops"] == 4
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_openapi_schema_describes_bodies_and_extensions(http):
    schema = http.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    completion = components["CompletionRequest"]["properties"]
    for name in (
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "user",
        "min_loops",
        "max_loops",
        "exit_threshold",
        "priority",
    ):
        assert name in completion, name
    assert components["CompletionRequest"]["additionalProperties"] is False
    assert set(components["CompletionRequest"]["required"]) == {"prompt"}
    chat = components["ChatCompletionRequest"]["properties"]
    for name in (
        "messages",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "min_loops",
        "max_loops",
        "exit_threshold",
        "priority",
    ):
        assert name in chat, name
    for choice in ("CompletionChoice", "ChatChoice", "ChatChunkChoice"):
        assert "exit_depths" in components[choice]["properties"]
    assert "loops" in components["Usage"]["properties"]
    assert "ChatCompletionChunk" in components
    paths = schema["paths"]
    post = paths["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/CompletionRequest"
    )
    ok = post["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in ok
    assert "422" not in post["responses"] and "400" in post["responses"]
    chat_post = paths["/v1/chat/completions"]["post"]
    assert chat_post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionResponse"
    )
    assert {"/v1/models", "/health", "/metrics"} <= set(paths)
    json.dumps(schema)  # serializable as published
