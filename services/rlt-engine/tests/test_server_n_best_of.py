"""`n` and `best_of` over real HTTP and the openai client.

- n choices per prompt, index = prompt_index * n + i, each with its own random stream: with a
  seed, choice i samples exactly as an n=1 request with seed + i (whatever else runs); greedy
  choices are identical; usage counts the prompt once and every generated token.
- best_of: that many sequences, the n of highest cumulative log-probability returned (best
  first) without logprobs the client did not ask for; best_of > n cannot stream (400).
- The prompt's KV is computed once per prompt (prefix cache hit counters), under both KV
  layouts; without prefix caching every choice computes it.
- A disconnect aborts every choice and frees every KV block; echo works with n > 1.
"""

from __future__ import annotations

import asyncio
import time

import httpx2
import openai
import pytest
from serving_harness import run_server, sse_events

SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(
        checkpoint, served_model_name="tiny", engine={"enable_prefix_caching": True}
    ) as running:
        yield running


def completion(http, **body) -> dict:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(http, **body) -> dict:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_choice_i_samples_with_seed_plus_i(http):
    got = completion(http, prompt="It is a truth", n=3, seed=11, **SAMPLED)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    for i, choice in enumerate(got["choices"]):
        alone = completion(http, prompt="It is a truth", seed=11 + i, **SAMPLED)["choices"][0]
        assert (choice["token_ids"], choice["text"]) == (alone["token_ids"], alone["text"])
    assert len({tuple(c["token_ids"]) for c in got["choices"]}) > 1  # own random streams
    again = completion(http, prompt="It is a truth", n=3, seed=11, **SAMPLED)
    assert again["choices"] == got["choices"]


def test_greedy_choices_are_identical(http):
    body = {**SAMPLED, "temperature": 0}
    got = completion(http, prompt="It is a truth", n=4, **body)
    assert len({(c["text"], tuple(c["token_ids"])) for c in got["choices"]}) == 1
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]


def test_prompt_lists_number_choices_prompt_major(http):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    got = completion(http, prompt=prompts, n=2, seed=3, **SAMPLED)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for choice in got["choices"]:
        p, i = divmod(choice["index"], 2)
        alone = completion(http, prompt=prompts[p], seed=3 + i, **SAMPLED)["choices"][0]
        assert choice["token_ids"] == alone["token_ids"]
    usage = got["usage"]
    assert usage["prompt_tokens"] == 4 + 3  # once per prompt
    assert usage["completion_tokens"] == 4 * 8 == usage["total_tokens"] - 7


def test_best_of_returns_the_n_of_highest_cumulative_logprob(http):
    body = {"prompt": "My dear Emma,", **SAMPLED}
    candidates = []
    for j in range(5):
        one = completion(http, seed=21 + j, logprobs=0, **body)["choices"][0]
        candidates.append((sum(one["logprobs"]["token_logprobs"]), j, one))
    ranked = sorted(candidates, key=lambda c: (-c[0], c[1]))
    got = completion(http, n=2, best_of=5, seed=21, **body)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["token_ids"] for c in got["choices"]] == [r[2]["token_ids"] for r in ranked[:2]]
    assert all(c["logprobs"] is None for c in got["choices"])  # not asked for: not returned
    assert got["usage"]["completion_tokens"] == 5 * 8  # every generated sequence counts
    # asked for: the returned choices carry their own logprobs
    with_logprobs = completion(http, n=1, best_of=5, seed=21, logprobs=1, **body)
    best = with_logprobs["choices"][0]["logprobs"]["token_logprobs"]
    assert sum(best) == pytest.approx(ranked[0][0], abs=1e-4)


def test_best_of_equal_to_n_streams_and_best_of_above_n_does_not(http):
    body = {"prompt": "It is", "n": 2, "best_of": 2, "seed": 5, **SAMPLED}
    events = streamed(http, "/v1/completions", body)
    refused = http.post("/v1/completions", json={**body, "best_of": 3, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"
    plain = completion(http, **body)
    for choice in plain["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_streamed_completions_with_n_equal_the_whole_answer(http):
    body = {"prompt": ["It is", "a truth"], "n": 3, "seed": 9, **SAMPLED}
    plain = completion(http, **body)
    events = streamed(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    for choice in plain["choices"]:
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [d for c in mine for d in c["exit_depths"]] == choice["exit_depths"]


def test_chat_n_streaming_and_not(http):
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "n": 3,
        "seed": 4,
        **SAMPLED,
    }
    plain = chat(http, **body)
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in plain["choices"]}) > 1
    events = streamed(http, "/v1/chat/completions", body)
    for choice in plain["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert (
            "".join(c["delta"].get("content", "") for c in mine) == (choice["message"]["content"])
        )
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    best = chat(http, **{**body, "n": 1, "best_of": 3})
    assert best["usage"]["completion_tokens"] == 3 * 8
    assert best["choices"][0]["logprobs"] is None


def test_echo_with_n(http):
    body = {"prompt": ["It is", "a truth"], "n": 2, "echo": True, "seed": 2, **SAMPLED}
    plain = completion(http, **{**body, "echo": False})
    echoed = completion(http, **body)
    for want, got in zip(plain["choices"], echoed["choices"], strict=True):
        prompt = body["prompt"][got["index"] // 2]
        assert got["text"] == prompt + want["text"]
    events = streamed(http, "/v1/completions", body)
    for got in echoed["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == got["index"]]
        assert mine[0]["text"] == body["prompt"][got["index"] // 2]
        assert "".join(c["text"] for c in mine) == got["text"]


def test_openai_client_n_and_best_of(client):
    out = client.completions.create(
        model="tiny",
        prompt="It is a truth",
        n=2,
        seed=8,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    best = client.completions.create(
        model="tiny", prompt="It is a truth", n=1, best_of=3, seed=8, max_tokens=6
    )
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    chat_out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, seed=8, max_tokens=6
    )
    assert [c.index for c in chat_out.choices] == [0, 1]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        seed=8,
        max_tokens=6,
        stream=True,
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in chat_out.choices}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="It is", n=2, best_of=4, stream=True)
    assert info.value.body["param"] == "best_of"


def test_disconnect_aborts_every_choice_and_frees_kv(server):
    aborted_before = server.client.stats().aborted_requests
    body = {"prompt": [1, 2, 3, 4, 5], "n": 4, "max_tokens": 400, "ignore_eos": True}
    with httpx2.Client(base_url=server.base_url, trust_env=False, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 6:
                    break
            assert server.client.stats().kv_blocks_used > 0
    stats = server.wait_idle(timeout=10)
    assert stats.aborted_requests == aborted_before + 4

    async def cancelled_non_streaming():
        async with httpx2.AsyncClient(base_url=server.base_url, trust_env=False) as client:
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while server.client.stats().running_requests == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(cancelled_non_streaming())
    assert server.wait_idle(timeout=10).aborted_requests == aborted_before + 8


PROMPT_64 = list(range(10, 74))


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompt_is_computed_once_per_prompt(checkpoint, layout, prefix_caching):
    engine = {"kv_layout": layout, "enable_prefix_caching": prefix_caching}
    with run_server(checkpoint, engine=engine) as server, server.http() as http:
        before = server.client.stats()
        got = completion(http, prompt=PROMPT_64, n=4, seed=1, **SAMPLED)
        stats = server.wait_idle()
        computed = stats.prompt_tokens - before.prompt_tokens
        hits = stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        block = 4  # serving_harness.ENGINE_DEFAULTS
        if prefix_caching:
            # once, plus per other choice what follows the last full page of prompt[:-1]
            assert computed == 64 + 3 * (64 - 60) <= 64 + 3 * block
            assert hits == 3 * 60
        else:
            assert (computed, hits) == (4 * 64, 0)
        # the choices are what n=1 requests with seed + i give (shared KV changes nothing)
        for i, choice in enumerate(got["choices"]):
            alone = completion(http, prompt=PROMPT_64, seed=1 + i, **SAMPLED)["choices"][0]
            assert choice["token_ids"] == alone["token_ids"]
