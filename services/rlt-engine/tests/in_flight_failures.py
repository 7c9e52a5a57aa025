"""Requests in flight when part of a server dies, and what each client must then have seen.

`RequestsInFlight.start(url)` sends, each on its own thread, a streaming completion (with
`stream_options.include_usage`), a streaming chat with `n = 2` (with usage too) and a
non-streaming completion, all long (`max_tokens` tokens, no stop token before), and returns
once each stream has received a token chunk: the streams are then in flight for sure (the
caller checks the non-streaming one on the server's side, e.g. its running requests). After the
kill, `assert_each_ended_unavailable()` checks what docs/serving.md ("What a client sees when
something fails") promises: every stream ends with each choice's last chunk, the usage chunk,
the JSON error event (503's type and code) and `[DONE]`; the plain request answers 503.
"""

from __future__ import annotations

import json
import threading

import httpx2

UNAVAILABLE = ("service_unavailable", "engine_unavailable")  # the error's (type, code)
WAIT_S = 60


class _Call:
    def __init__(self, url: str, path: str, body: dict) -> None:
        self.url, self.path, self.body = url, path, body
        self.lines: list[str] = []
        self.response: httpx2.Response | None = None
        self.failure: BaseException | None = None
        self.got_tokens = threading.Event()  # a chunk with generated text arrived (streams)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx2.Client(base_url=self.url, trust_env=False, timeout=WAIT_S) as http:
                if not self.body.get("stream"):
                    self.response = http.post(self.path, json=self.body)
                    return
                with http.stream("POST", self.path, json=self.body) as response:
                    self.response = response
                    for line in response.iter_lines():
                        self.lines.append(line)
                        if _has_tokens(line):
                            self.got_tokens.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the checks
            self.failure = exc
        finally:
            self.got_tokens.set()
            self.done.set()

    def events(self) -> list:
        """The stream's SSE events: JSON objects, and "[DONE]" as a string."""
        events = []
        for line in self.lines:
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events


def _has_tokens(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line[len("data: ") :])
    return any(
        choice.get("text") or (choice.get("delta") or {}).get("content")
        for choice in chunk.get("choices") or ()
    )


class RequestsInFlight:
    def __init__(self, url: str, *, max_tokens: int, model: str | None = None) -> None:
        # min_tokens: no stop token (a chat's end of turn included) ends them early
        common = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True}
        if model is not None:
            common["model"] = model
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        messages = [{"role": "user", "content": "Tell me a long story."}]
        self.completion = _Call(
            url, "/v1/completions", {"prompt": "It is a truth", **common, **usage}
        )
        self.chat = _Call(
            url, "/v1/chat/completions", {"messages": messages, "n": 2, **common, **usage}
        )
        self.plain = _Call(url, "/v1/completions", {"prompt": "My dear Emma,", **common})
        self.streams = {"completion": (self.completion, 1), "chat": (self.chat, 2)}

    @property
    def engine_requests(self) -> int:
        """Engine requests these make: 1 + 2 + 1."""
        return 4

    def start(self) -> RequestsInFlight:
        for call in (self.completion, self.chat, self.plain):
            call.thread.start()
        for name, (call, _) in self.streams.items():
            assert call.got_tokens.wait(WAIT_S), f"the {name} stream got no token"
            assert call.failure is None and not call.done.is_set(), (name, call.failure)
        return self

    def join(self) -> None:
        for call in (self.completion, self.chat, self.plain):
            assert call.done.wait(WAIT_S), f"{call.path} did not end"
            call.thread.join(WAIT_S)

    def assert_each_ended_unavailable(self) -> None:
        self.join()
        for name, (call, choices) in self.streams.items():
            assert call.failure is None, (name, call.failure)
            assert call.response is not None and call.response.status_code == 200
            usage = assert_failed_stream(call.events(), choices=choices, error=UNAVAILABLE)
            assert usage["completion_tokens"] >= choices, (name, usage)  # what they received
        plain = self.plain
        assert plain.failure is None, plain.failure
        assert plain.response.status_code == 503, plain.response.text
        error = plain.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == UNAVAILABLE, error


def assert_failed_stream(events: list, *, choices: int, error: tuple) -> dict:
    """A stream that failed after it started (`error`: its (type, code)): every choice's last
    chunk (a finish_reason), the usage chunk (the stream asked for it), then the error event
    and [DONE], nothing after. Returns the usage and the error's message."""
    assert len(events) >= 3 and events[-1] == "[DONE]", events[-3:]
    body = events[-2]
    assert isinstance(body, dict) and set(body) == {"error"}, events[-3:]
    detail = body["error"]
    assert set(detail) == {"message", "type", "param", "code"}, detail
    assert (detail["type"], detail["code"]) == error, detail
    assert isinstance(detail["message"], str) and detail["message"]
    usage = events[-3]
    assert usage["choices"] == [] and usage["usage"] is not None, usage
    chunks = events[:-3]
    assert all(isinstance(e, dict) and e.get("usage") is None for e in chunks), chunks
    finished = [c["index"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(choices)), finished
    return {**usage["usage"], "message": detail["message"]}
