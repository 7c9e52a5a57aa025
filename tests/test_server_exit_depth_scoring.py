"""`score_at_exit_depth` over real HTTP (issue 25 part 2): completions return each prompt token's
exit depth next to vLLM's `prompt_logprobs` (and, with echo + logprobs, in the choice's logprobs
object), chat next to its `prompt_logprobs`; the scores and depths equal the fp64 oracle's
teacher-forced decode; misuse is a 400 JSON error naming the field. The server checks for KV
leaks when the module ends (serving_harness.run_server)."""

from __future__ import annotations

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from serving_harness import run_server, sse_events

PROMPT = [5, 17, 200, 3, 99, 42, 7, 8, 9]
LOOPS = {"exit_threshold": 0.5, "min_loops": 1, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def teacher_forced(checkpoint):
    """The oracle's decode of PROMPT from position 0 under LOOPS' rule (then 2 tokens)."""
    oracle = GenerationOracle(DenseOuro(checkpoint), "last_exited")
    result = oracle.generate(
        OracleRequest(
            tuple(PROMPT), 2, min_loops=1, threshold=0.5, ignore_eos=True, prompt_at_exit_depth=True
        )
    )
    assert result.min_gate_margin > 1e-4  # well conditioned against the fp32 server
    assert len(set(result.prompt_exit_depths[1:])) >= 2  # depths really vary
    return result


def test_completions_return_each_prompt_tokens_exit_depth(http, teacher_forced):
    body = {"prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 1, "score_at_exit_depth": True}
    response = http.post("/v1/completions", json={**body, **LOOPS})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["prompt_exit_depths"] == teacher_forced.prompt_exit_depths
    assert choice["prompt_logprobs"][0] is None
    scores = [
        entry[str(token)]["logprob"]
        for token, entry in zip(PROMPT[1:], choice["prompt_logprobs"][1:], strict=True)
    ]
    assert scores == pytest.approx(teacher_forced.prompt_logprobs[1:], abs=1e-4)
    full_depth = http.post("/v1/completions", json={**body, "score_at_exit_depth": False, **LOOPS})
    assert full_depth.json()["choices"][0]["prompt_exit_depths"] is None


def test_echo_logprobs_carry_the_depths_in_the_logprobs_object(http, teacher_forced):
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, **LOOPS}
    scored = http.post("/v1/completions", json={**body, "score_at_exit_depth": True})
    assert scored.status_code == 200, scored.text
    choice = scored.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["prompt_exit_depths"] == teacher_forced.prompt_exit_depths
    assert choice["prompt_exit_depths"] == teacher_forced.prompt_exit_depths
    echoed = logprobs["token_logprobs"][: len(PROMPT)]
    assert echoed[0] is None
    assert echoed[1:] == pytest.approx(teacher_forced.prompt_logprobs[1:], abs=1e-4)
    # the generated tokens follow the teacher-forced prompt (token 0 at its last exit depth)
    assert choice["exit_depths"] == teacher_forced.exit_depths
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert "prompt_exit_depths" not in plain["logprobs"]  # OpenAI's object, unchanged
    assert plain["prompt_exit_depths"] is None


def test_a_stream_carries_the_depths_with_the_prompt_scores(http, teacher_forced):
    """Streamed, the prompt's scores and depths come with the first generated token's chunk."""
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True}
    with http.stream(
        "POST", "/v1/completions", json={**body, "score_at_exit_depth": True, **LOOPS}
    ) as response:
        events = sse_events(response.iter_lines())
    scored = [
        e["choices"][0]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["prompt_exit_depths"] is not None
    ]
    assert len(scored) == 1
    assert scored[0]["prompt_exit_depths"] == teacher_forced.prompt_exit_depths
    assert scored[0]["logprobs"]["prompt_exit_depths"] == teacher_forced.prompt_exit_depths


def test_chat_returns_the_rendered_prompts_depths(http):
    messages = [{"role": "user", "content": "It is a truth"}]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0, **LOOPS}
    scored = http.post("/v1/chat/completions", json={**body, "score_at_exit_depth": True})
    assert scored.status_code == 200, scored.text
    depths, scores = scored.json()["prompt_exit_depths"], scored.json()["prompt_logprobs"]
    assert len(depths) == len(scores) and depths[0] is None
    assert all(1 <= d <= 4 for d in depths[1:])
    assert http.post("/v1/chat/completions", json=body).json()["prompt_exit_depths"] is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "score_at_exit_depth": True}),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "score_at_exit_depth": True}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "score_at_exit_depth": "yes"}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "score_at_exit_depth": True},
        ),
    ],
)
def test_misuse_is_a_400_naming_the_field(http, path, body):
    response = http.post(path, json={**body, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "score_at_exit_depth" and "score_at_exit_depth" in error["message"]
