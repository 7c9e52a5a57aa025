"""Completions `echo` and the sampled token in `top_logprobs`, over real HTTP and the openai
client.

- echo=true prepends each prompt's text (a token prompt decoded) to its choice, streaming or
  not; with logprobs the prompt's tokens come first with their full-depth log-probabilities
  (null for the first token), equal to the engine's prompt scoring.
- top_logprobs hold the requested alternatives plus the sampled token when it is not among
  them (completions: logprobs=0 gives the sampled token alone; chat: top_logprobs >= 1).
"""

from __future__ import annotations

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle
from serving_harness import run_server, sse_events


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("prompts", [["It is", "a truth"], [[5, 6, 7], [40, 41]]])
def test_echo_prepends_each_prompt(http, server, prompts):
    plain = http.post("/v1/completions", json={"prompt": prompts, **GREEDY}).json()
    echoed = http.post("/v1/completions", json={"prompt": prompts, "echo": True, **GREEDY})
    assert echoed.status_code == 200, echoed.text
    decode = server.engine.tokenizer.decode
    texts = [p if isinstance(p, str) else decode(p, skip_special_tokens=False) for p in prompts]
    for prefix, want, got in zip(texts, plain["choices"], echoed.json()["choices"], strict=True):
        assert got["text"] == prefix + want["text"]
        assert got["exit_depths"] == want["exit_depths"]  # only generated tokens
    assert echoed.json()["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_echo_with_logprobs_scores_the_prompt(http, tiny_checkpoint):
    body = {"prompt": "It is a", "echo": True, "logprobs": 2, **GREEDY}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt = http.post("/tokenize", json={"prompt": "It is a"}).json()["tokens"]
    prompt_tokens = len(prompt)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == prompt_tokens + 5
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    oracle = GenerationOracle(
        DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), "last_exited"
    )
    # the server's fp32 against the fp64 oracle: 1e-4 on log-probabilities of magnitude ~6
    assert logprobs["token_logprobs"][1:prompt_tokens] == pytest.approx(
        oracle.prompt_logprobs(tuple(prompt))[1:], abs=1e-4
    )
    for i in range(1, prompt_tokens):  # the 2 alternatives plus the prompt token itself
        top = logprobs["top_logprobs"][i]
        assert 2 <= len(top) <= 3 and max(top.values()) <= 0
        assert top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][prompt_tokens:])
    assert "".join(logprobs["tokens"][:prompt_tokens]) == "It is a"
    assert logprobs["text_offset"][prompt_tokens] == len("It is a")
    assert choice["text"].startswith("It is a")


def test_streamed_echo_sends_the_prompt_first(http):
    body = {"prompt": "It is", "echo": True, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response.iter_lines())
    plain = http.post("/v1/completions", json={"prompt": "It is", **GREEDY}).json()
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == "It is" and chunks[0]["exit_depths"] == []
    assert "".join(c["text"] for c in chunks) == "It is" + plain["choices"][0]["text"]


def test_the_openai_client_reads_echo_with_logprobs(client):
    greedy = dict(max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt="It is", **greedy)
    echoed = client.completions.create(
        model="tiny", prompt="It is", echo=True, logprobs=1, **greedy
    )
    assert echoed.choices[0].text == "It is" + plain.choices[0].text
    token_logprobs = echoed.choices[0].logprobs.token_logprobs
    assert token_logprobs[0] is None and all(isinstance(lp, float) for lp in token_logprobs[1:])


def test_completion_top_logprobs_include_the_sampled_token(http):
    body = {"prompt": "It is", "max_tokens": 16, "temperature": 2.0, "seed": 7, "ignore_eos": True}
    logprobs = http.post("/v1/completions", json={**body, "logprobs": 1}).json()["choices"][0][
        "logprobs"
    ]
    outside = 0
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top[token] == pytest.approx(logprob)
        assert len(top) in (1, 2)
        outside += len(top) == 2
    assert outside > 0  # at temperature 2 some sampled token was not the most likely one

    zero = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    for token, logprob, top in zip(
        zero["logprobs"]["tokens"],
        zero["logprobs"]["token_logprobs"],
        zero["logprobs"]["top_logprobs"],
        strict=True,
    ):
        assert top == {token: pytest.approx(logprob)}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_include_the_sampled_token(http, stream):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "temperature": 2.0,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "stream": stream,
    }
    if stream:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = sse_events(response.iter_lines())
        content = [
            entry
            for event in events[:-1]
            for entry in ((event["choices"][0].get("logprobs") or {}).get("content") or [])
        ]
    else:
        content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"][
            "content"
        ]
    assert len(content) == 16
    outside = 0
    for entry in content:
        top = entry["top_logprobs"]
        assert 1 <= len(top) <= 2
        assert any(
            t["token"] == entry["token"] and t["logprob"] == pytest.approx(entry["logprob"])
            for t in top
        )
        if len(top) == 2:
            outside += 1
            assert top[1]["token"] == entry["token"]  # after the requested alternative
            assert top[0]["logprob"] >= top[1]["logprob"]
    assert outside > 0


def test_the_openai_client_reads_chat_top_logprobs(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=2.0,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    for entry in reply.choices[0].logprobs.content:
        assert entry.token in [t.token for t in entry.top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_scores_without_generating(http, stream):
    """OpenAI's scoring call (lm-evaluation-harness's loglikelihood): echo, logprobs, max_tokens
    0. The choice is the prompt alone with its scores; usage counts no completion token."""
    body = {"prompt": ["It is a", "a truth"], "echo": True, "logprobs": 1, "max_tokens": 0}
    full = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response.iter_lines())
        chunks = [e for e in events[:-1] if e["choices"]]
        usage = events[-2]["usage"]
        for index, prompt in enumerate(["It is a", "a truth"]):
            mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == prompt
            assert mine[-1]["finish_reason"] == "length"
            (scored,) = [c["logprobs"] for c in mine if c["logprobs"]]
            want = full["choices"][index]["logprobs"]
            assert scored["token_logprobs"] == want["token_logprobs"][: len(scored["tokens"])]
    else:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        usage = result["usage"]
        for choice, want in zip(result["choices"], full["choices"], strict=True):
            prompt_tokens = len(choice["logprobs"]["tokens"])
            assert choice["text"] == want["text"][: len(choice["text"])]
            assert choice["exit_depths"] == [] and choice["finish_reason"] == "length"
            assert (
                choice["logprobs"]["token_logprobs"]
                == (want["logprobs"]["token_logprobs"][:prompt_tokens])
            )
            assert len(want["logprobs"]["tokens"]) == prompt_tokens + 1
    assert usage["completion_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] > 0


def test_max_tokens_zero_without_scoring_is_refused(http):
    response = http.post("/v1/completions", json={"prompt": "It is", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(http):
    body = {"prompt": "It is a truth", "prompt_logprobs": 2, **GREEDY}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    echoed = http.post(
        "/v1/completions", json={**body, "prompt_logprobs": None, "echo": True, "logprobs": 2}
    ).json()["choices"][0]["logprobs"]
    prompt = http.post("/tokenize", json={"prompt": "It is a truth"}).json()["tokens"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert choice["logprobs"] is None  # no logprobs asked for the generated tokens
    for i, entry in enumerate(entries[1:], 1):
        token = entry[str(prompt[i])]
        assert token["logprob"] == echoed["token_logprobs"][i]
        assert token["rank"] >= 1 and token["decoded_token"] == echoed["tokens"][i]
        # the 2 alternatives hold ranks 1 and 2; the prompt token's entry replaces its own
        others = sorted(e["rank"] for key, e in entry.items() if key != str(prompt[i]))
        assert others == [r for r in (1, 2) if r != token["rank"]]
    refused = http.post("/v1/completions", json={**body, "prompt_logprobs": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_echo_scores_every_choice_of_several_prompts(http):
    """n = 2 choices of 2 prompts: each choice carries its own prompt's scores (siblings
    compute the prompt each, as a scored prompt takes no prefix-cache hit)."""
    prompts = ["It is a", "a truth universally"]
    body = {"prompt": prompts, "n": 2, "echo": True, "logprobs": 1, "max_tokens": 2}
    choices = http.post("/v1/completions", json={**body, "temperature": 0.8, "seed": 3}).json()[
        "choices"
    ]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        scored = [c["logprobs"] for c in choices[2 * p : 2 * p + 2]]
        length = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
        first, second = (s["token_logprobs"][:length] for s in scored)
        assert first == second and first[0] is None
        assert all(isinstance(lp, float) for lp in first[1:])


def test_chat_prompt_logprobs_score_the_rendered_prompt(http):
    messages = [{"role": "user", "content": "It is a truth"}]
    body = {"messages": messages, "prompt_logprobs": 1, **GREEDY}
    result = http.post("/v1/chat/completions", json=body).json()
    entries = result["prompt_logprobs"]
    assert entries[0] is None and len(entries) == result["usage"]["prompt_tokens"]
    assert all(min(e["rank"] for e in entry.values()) == 1 for entry in entries[1:])
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
    plain = http.post("/v1/chat/completions", json={"messages": messages, **GREEDY}).json()
    assert plain["prompt_logprobs"] is None


def test_lm_evaluation_harness_loglikelihood_request(http, tiny_checkpoint):
    """The request lm-evaluation-harness's `local-completions` sends for a loglikelihood task
    (token ids of context + continuation, echo, logprobs 1, max_tokens 1, temperature 0) and
    its parsing (the continuation's entries: token_logprobs[ctxlen:-1], greedy if each equals
    its top entry's maximum) give the fp64 oracle's log-likelihood at full depth."""
    context, continuation = [5, 17, 200, 3, 99], [42, 7, 8]
    body = {
        "prompt": [context + continuation],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    oracle = GenerationOracle(
        DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), "last_exited"
    )
    want = oracle.prompt_logprobs(tuple(context + continuation))[ctxlen:]
    assert sum(token_logprobs) == pytest.approx(sum(want), abs=1e-4)
    greedy = [lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True)]
    assert len(greedy) == len(continuation)
