"""vLLM's sampling extensions over real HTTP (httpx2 and the official openai client):
presence_penalty / frequency_penalty / logit_bias (OpenAI fields; logit_bias keys are token ids
as strings) and repetition_penalty / min_p / min_tokens (vLLM extras, `extra_body`) on both
/v1/completions and /v1/chat/completions. The server's tokens equal the engine's for the same
SamplingParams; out-of-range values answer 400 naming the field; no KV leaks (the harness
checks at shutdown)."""

from __future__ import annotations

import openai
import pytest
from rlt import LLM, SamplingParams
from serving_harness import ENGINE_DEFAULTS, run_server

PROMPT = [5, 17, 200, 3, 99, 42, 7]
EOS = 0


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, **ENGINE_DEFAULTS)
    yield lambda params: llm.generate([PROMPT], params)[0]
    llm.shutdown()


def completion(http, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = http.post("/v1/completions", json={**body, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_penalties_and_extras_give_the_engines_tokens(http, reference):
    fields = dict(
        presence_penalty=0.5,
        frequency_penalty=1.0,
        repetition_penalty=1.6,
        ignore_eos=True,
        max_tokens=10,
    )
    choice = completion(http, **fields)
    expected = reference(
        SamplingParams(
            max_tokens=10,
            presence_penalty=0.5,
            frequency_penalty=1.0,
            repetition_penalty=1.6,
            ignore_eos=True,
        )
    )
    assert choice["token_ids"] == expected.token_ids
    plain = completion(http, ignore_eos=True, max_tokens=10)
    assert plain["token_ids"] != choice["token_ids"]  # the penalties changed something
    random = dict(temperature=0.9, seed=4, min_p=0.1, ignore_eos=True, max_tokens=10)
    assert (
        completion(http, **random)["token_ids"]
        == reference(
            SamplingParams(max_tokens=10, temperature=0.9, seed=4, min_p=0.1, ignore_eos=True)
        ).token_ids
    )


def test_logit_bias_keys_are_token_id_strings(http):
    choice = completion(http, logit_bias={"33": 100}, ignore_eos=True, max_tokens=4)
    assert choice["token_ids"] == [33] * 4
    chat = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
            "temperature": 1.0,
            "logit_bias": {"33": 100.0},
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["token_ids"] == [33] * 3


def test_several_choices_and_best_of_carry_the_extensions(http):
    body = {
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 1.0,
        "n": 2,
        "best_of": 3,
        "logit_bias": {"33": 100},
        "repetition_penalty": 1.3,
        "min_tokens": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["token_ids"] for c in response.json()["choices"]] == [[33] * 3] * 2


def test_min_tokens_holds_back_eos(http):
    eager_stop = completion(http, logit_bias={str(EOS): 100})
    assert (eager_stop["token_ids"], eager_stop["finish_reason"]) == ([EOS], "stop")
    held = completion(http, logit_bias={str(EOS): 100}, min_tokens=5)
    assert held["finish_reason"] == "stop" and len(held["token_ids"]) == 6
    assert EOS not in held["token_ids"][:5]


def test_openai_client_passes_every_field(client):
    bias = {"33": 100}
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        presence_penalty=0.3,
        frequency_penalty=0.3,
        logit_bias=bias,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0.7,
        seed=3,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        logit_bias={str(EOS): 100},
        extra_body={"repetition_penalty": 0.9, "min_p": 0.05, "min_tokens": 4},
    )
    # EOS is forced but held back by min_tokens = max_tokens: the reply ends by length
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"repetition_penalty": 0}
        )
    assert info.value.body["param"] == "repetition_penalty"


BAD_VALUES = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": 2.5}, "min_tokens"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"320": 1.0}}, "logit_bias"),  # outside the 320-token vocabulary
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("fields", "param"), BAD_VALUES)
def test_out_of_range_values_answer_400_naming_the_field(http, server, endpoint, fields, param):
    if endpoint == "/v1/completions":
        body = {"prompt": PROMPT, "max_tokens": 8}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = http.post(endpoint, json={**body, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0] in error["message"]
    assert server.wait_idle().kv_blocks_used == 0
