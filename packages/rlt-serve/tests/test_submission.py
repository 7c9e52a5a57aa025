"""How rlt-serve submits the prompts of one request, against scripted EngineClients.

- A client with `submit_many` (rlt_contracts.BatchSubmitter) gets a list of prompts in one
  call; a refused batch leaves nothing to cancel.
- A client that disconnects while its prompts are being submitted has every accepted prompt
  cancelled (batch client), or stops being fed the remaining prompts (one-by-one client).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from rlt_contracts import BatchSubmitter, EngineRequest, OverloadedError
from rlt_serve import build_app
from test_app_with_fake_engine import FakeClient, FakeTokenizer


class BatchFakeClient(FakeClient):
    """FakeClient plus submit_many (all or none)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[EngineRequest]] = []
        self.refuse_batch: BaseException | None = None

    async def submit(self, request: EngineRequest) -> None:
        raise AssertionError("a batch client gets every prompt list through submit_many")

    async def submit_many(self, requests) -> None:
        if self.refuse_batch is not None:
            raise self.refuse_batch
        self.batches.append(list(requests))
        self.submitted.extend(requests)


def test_a_prompt_list_is_submitted_in_one_call():
    fake = BatchFakeClient()
    assert isinstance(fake, BatchSubmitter)
    with TestClient(build_app(fake, served_model_name="m", tokenizer=FakeTokenizer())) as http:
        response = http.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
        assert response.status_code == 200
        assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
        assert [len(batch) for batch in fake.batches] == [3]

        fake.refuse_batch = OverloadedError("queue full")
        response = http.post("/v1/completions", json={"prompt": ["d", "e"], "stream": True})
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "overloaded"
        assert fake.cancelled == []  # nothing was queued, nothing to cancel


class _Disconnecting:
    """An ASGI conversation whose client leaves while the server submits its prompts."""

    def __init__(self, body: dict) -> None:
        self.body = json.dumps(body).encode()
        self.submitting = asyncio.Event()
        self.received = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.received += 1
        if self.received == 1:
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.submitting.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def submission_in_progress(self) -> None:
        """Called by the engine client inside a submit: let the disconnect be noticed."""
        self.submitting.set()
        for _ in range(10):
            await asyncio.sleep(0)


def run_request(app, conversation: _Disconnecting) -> None:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    asyncio.run(app(scope, conversation.receive, conversation.send))


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_during_batch_submission_cancels_every_prompt(stream):
    conversation = _Disconnecting({"prompt": ["a", "b", "c"], "stream": stream})

    class SlowBatch(BatchFakeClient):
        async def submit_many(self, requests) -> None:
            await conversation.submission_in_progress()
            await super().submit_many(requests)

    fake = SlowBatch()
    run_request(build_app(fake, served_model_name="m", tokenizer=FakeTokenizer()), conversation)
    assert len(fake.submitted) == 3
    assert set(fake.cancelled) == {r.request_id for r in fake.submitted}  # (some twice: no-op)


def test_a_disconnect_during_one_by_one_submission_stops_it():
    conversation = _Disconnecting({"prompt": ["a", "b", "c", "d"]})

    class SlowOneByOne(FakeClient):
        async def submit(self, request: EngineRequest) -> None:
            await conversation.submission_in_progress()
            await super().submit(request)

    fake = SlowOneByOne()
    assert not isinstance(fake, BatchSubmitter)
    run_request(build_app(fake, served_model_name="m", tokenizer=FakeTokenizer()), conversation)
    assert len(fake.submitted) == 1  # the other three were never submitted
    assert fake.cancelled == [fake.submitted[0].request_id]
