"""rlt-serve against a scripted EngineClient (no engine, no model): the HTTP layer alone.

Covered: response and chunk shapes, error mapping of every EngineClient error, cleanup of
already submitted prompts when a later one is refused, in-band stream errors, /health after an
engine failure, and the validation-error -> OpenAI error translation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from rlt_contracts import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    OverloadedError,
    RequestOutputDelta,
    RequestTimings,
)
from rlt_serve import LoopDefaults, build_app

INFO = ModelInfo(
    name="fake", path="/fake", max_model_len=64, vocab_size=128, num_loops=4, eos_token_ids=(0,)
)


class FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 128 for c in text]

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(t) for t in token_ids)

    def convert_tokens_to_ids(self, token):
        return 2

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


class FakeClient:
    """Answers every request with the tokens of "ok!" at depths 4, 2, 3, in two deltas."""

    def __init__(self) -> None:
        self.submitted: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.refuse: dict[int, BaseException] = {}  # submit index -> error
        self.fail_stream: BaseException | None = None
        self.shut_down = False
        self.logprobs = False  # the deltas carry the sampled tokens' log-probabilities

    def model_info(self) -> ModelInfo:
        return INFO

    async def submit(self, request: EngineRequest) -> None:
        error = self.refuse.get(len(self.submitted))
        self.submitted.append(request)
        if error is not None:
            raise error

    async def _deltas(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        def logprobs(n: int) -> dict:
            return {"logprobs": (-0.5,) * n, "top_logprobs": ((),) * n} if self.logprobs else {}

        yield RequestOutputDelta(
            request_id=request_id,
            token_ids=(111, 107),
            exit_depths=(4, 2),
            text="ok",
            num_prompt_tokens=3,
            **logprobs(2),
        )
        if self.fail_stream is not None:
            raise self.fail_stream
        yield RequestOutputDelta(
            request_id=request_id,
            token_ids=(33,),
            exit_depths=(3,),
            text="!",
            finished=True,
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=3,
            **logprobs(1),
        )

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        return self._deltas(request_id)

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=10, kv_blocks_used=1)

    async def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def fake():
    return FakeClient()


@pytest.fixture
def http(fake):
    app = build_app(
        fake,
        served_model_name="m",
        tokenizer=FakeTokenizer(),
        loop_defaults=LoopDefaults(min_loops=1, exit_threshold=0.5),
        engine_error=lambda: fake.shut_down and EngineDeadError("gone") or None,
    )
    with TestClient(app) as client:
        yield client
    assert fake.shut_down  # the lifespan shut the client down


def events(text: str) -> list:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def test_completion_body_and_extensions(http, fake):
    response = http.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 3, "top_k": 0, "return_token_ids": True},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"] == [
        {
            "index": 0,
            "text": "ok!",
            "logprobs": None,
            "finish_reason": "length",
            "exit_depths": [4, 2, 3],
            "token_ids": [111, 107, 33],
            "prompt_logprobs": None,  # vLLM's field, null unless asked for
            "prompt_exit_depths": None,  # rlt: with score_at_exit_depth
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "loops": {"total_loops": 9, "mean_loops_per_token": 2.5, "model_depth": 4},
    }
    [request] = fake.submitted
    assert request.prompt_token_ids == (97, 98, 99)
    params = request.sampling
    assert (params.max_tokens, params.top_k, params.min_loops, params.exit_threshold) == (
        3,
        -1,
        1,
        0.5,
    )
    assert params.temperature == 1.0 and params.seed is None  # OpenAI defaults


def test_chat_stream_chunks(http, fake):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
    }
    response = http.post("/v1/chat/completions", json=body)
    chunks = events(response.text)
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:3]] == ["ok", "!"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:3]] == [None, "length"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
    params = fake.submitted[0].sampling
    assert params.stop_token_ids == (2,)  # the chat turn end
    assert fake.submitted[0].prompt_token_ids == tuple(ord(c) for c in "<user>hi<assistant>")


@pytest.mark.parametrize(
    ("error", "status", "param", "code"),
    [
        (InvalidRequestError("max_loops", "too deep"), 400, "max_loops", None),
        (OverloadedError("queue full"), 429, None, "overloaded"),
        (EngineDeadError("gone"), 503, None, "engine_unavailable"),
    ],
)
def test_engine_errors_map_to_statuses(http, fake, error, status, param, code):
    fake.refuse[0] = error
    response = http.post("/v1/completions", json={"prompt": "abc", "stream": True})
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["code"] == code
    if status == 429:
        assert response.headers["retry-after"] == "1"


def test_a_refused_prompt_cancels_the_ones_already_submitted(http, fake):
    fake.refuse[1] = OverloadedError("queue full")
    response = http.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
    assert response.status_code == 429
    assert fake.cancelled == [fake.submitted[0].request_id]
    assert len(fake.submitted) == 2


def test_engine_failure_mid_stream_is_reported_in_band(http, fake):
    fake.fail_stream = EngineDeadError("device lost")
    response = http.post("/v1/completions", json={"prompt": "abc", "stream": True})
    assert response.status_code == 200
    chunks = events(response.text)
    assert chunks[0]["choices"][0]["text"] == "ok"
    # the open choice ends ("abort", nothing new), then the error event and [DONE]
    assert chunks[1]["choices"][0]["finish_reason"] == "abort"
    assert chunks[1]["choices"][0]["text"] == ""
    error = chunks[2]["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
    assert "device lost" in error["message"] and chunks[3:] == ["[DONE]"]
    metrics = http.get("/metrics").text
    labels = 'endpoint="completions",model_name="m",outcome="unavailable"'
    assert f"rlt:http_requests_total{{{labels}}} 1.0" in metrics


class _DecodeFailsOn(FakeTokenizer):
    """A bug in the output path that hits one token: a choice's finishing delta."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def decode(self, token_ids, skip_special_tokens=True):
        if self.token_id in token_ids:
            raise RuntimeError("simulated bug building the last chunk")
        return super().decode(token_ids, skip_special_tokens)


def test_a_choice_whose_finishing_chunk_fails_still_ends_with_abort(http, fake):
    """The engine request finished, but building its last chunk raised: the client never saw
    the finish_reason, so the choice still gets its "abort" end before the error event."""
    fake.logprobs = True
    http.app.state.rlt.tokenizer = _DecodeFailsOn(33)
    body = {
        "prompt": "abc",
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    chunks = events(http.post("/v1/completions", json=body).text)
    assert (
        chunks[0]["choices"][0]["text"] == "ok" and chunks[0]["choices"][0]["finish_reason"] is None
    )
    assert (
        chunks[1]["choices"][0]["finish_reason"] == "abort"
        and chunks[1]["choices"][0]["text"] == ""
    )
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 3
    assert chunks[3]["error"]["type"] == "internal_error" and chunks[4:] == ["[DONE]"]
    assert fake.cancelled == []  # the engine request had finished: nothing to cancel


def test_health_follows_the_engine(http, fake):
    assert http.get("/health").json() == {"status": "ok", "detail": None}
    fake.shut_down = True
    response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "dead"
    fake.shut_down = False


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": 3}, "prompt", "must be one of str, list[str], list[int], list[list[int]]"),
        ({"prompt": "a", "max_token": 3}, "max_token", "Unrecognized request argument"),
        (
            {"prompt": "a", "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "valid boolean",
        ),
        ({"prompt": "a", "seed": 2**63}, "seed", "< 2**63"),
    ],
)
def test_validation_errors_name_the_field(http, body, param, message):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


class FinalClient(FakeClient):
    """Also a `FinalOutputs` client: a non-streaming response reads one delta per choice."""

    def __init__(self) -> None:
        super().__init__()
        self.final_reads: list[str] = []

    def stream_final(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        self.final_reads.append(request_id)

        async def whole() -> AsyncIterator[RequestOutputDelta]:
            yield RequestOutputDelta(
                request_id=request_id,
                token_ids=(111, 107, 33),
                exit_depths=(4, 2, 3),
                text="ok!",
                finished=True,
                finish_reason=FinishReason.LENGTH,
                num_prompt_tokens=3,
                timings=RequestTimings(queued=1.0, scheduled=1.0, first_token=1.0, last_token=1.0),
            )

        return whole()


def metric(text: str, name: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(name)).rsplit(" ", 1)[1])


def test_non_streaming_responses_read_one_final_output_per_choice():
    """With a FinalOutputs client the body equals the one accumulated from deltas, the choice's
    output is read once, and the token metrics count as for a stream (1 first token, 2 gaps)."""
    bodies = {}
    for client in (FakeClient(), FinalClient()):
        app = build_app(client, served_model_name="m", tokenizer=FakeTokenizer())
        with TestClient(app) as http:
            response = http.post(
                "/v1/completions",
                json={"prompt": "abc", "max_tokens": 3, "return_token_ids": True, "n": 2},
            )
            assert response.status_code == 200, response.text
            metrics = http.get("/metrics").text
        body = response.json()
        bodies[type(client).__name__] = (body["choices"], body["usage"])
        assert metric(metrics, "rlt:time_to_first_token_seconds_count") == 2
        assert metric(metrics, "rlt:inter_token_latency_seconds_count") == 4
    assert bodies["FinalClient"] == bodies["FakeClient"]
    assert client.final_reads == [r.request_id for r in client.submitted]
