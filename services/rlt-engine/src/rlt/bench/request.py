"""Send one streaming request (`wire_client.WireClient`, or anything with the `openai`
client's `create` and stream interface) and measure it.

Definitions (times from `time.perf_counter`, in seconds):
- send: just before the request is handed to the client (after any concurrency wait).
- token chunk: a stream chunk whose choice carries at least one token: a non-empty
  `exit_depths` (rlt's extension: one depth per token) or, where the server sends no
  `exit_depths`, non-empty text. Chat's opening role-only chunk and the usage chunk are not.
- TTFT: send -> the first token chunk arrives.
- ITL: the gap between consecutive token chunks, recorded once per chunk. A chunk can carry
  several tokens (a server merges deltas when the client reads slower than it generates); its
  gap is then not divided among them, as in vLLM's benchmark. `chunk_tokens` keeps how many
  tokens each chunk carried (exactly, from `exit_depths`; 1 per chunk without it), and TPOT is
  the per-token figure.
- E2E latency: send -> the stream ends.
- output tokens: `usage.completion_tokens` of the final chunk (the request asks for it with
  `stream_options.include_usage`); without usage, the tokens counted in chunks.
- loops per token: the mean of `exit_depths[1:]` (token 0 comes from prefill at full depth).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from rlt_contracts import ConfigurationError

from rlt.bench.datasets import BenchRequest

CHAT_SUFFIX = "/chat/completions"
COMPLETIONS_SUFFIX = "/completions"
# `--backend` (vLLM's names of its OpenAI-compatible request functions) -> whether it speaks
# chat; "vllm" is vLLM's older name of the completions one
BACKENDS = {"openai": False, "vllm": False, "openai-chat": True}


@dataclass(frozen=True)
class Endpoint:
    """Where to send: `api_base` is what the openai client calls its base URL (".../v1")."""

    base_url: str
    path: str
    chat: bool

    @property
    def api_base(self) -> str:
        suffix = CHAT_SUFFIX if self.chat else COMPLETIONS_SUFFIX
        return self.base_url.rstrip("/") + self.path[: -len(suffix)]

    @classmethod
    def parse(cls, base_url: str, path: str) -> Endpoint:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError("base_url", f"must start with http:// or https://: {base_url}")
        path = "/" + path.strip("/")
        if path.endswith(CHAT_SUFFIX):
            return cls(base_url, path, chat=True)
        if path.endswith(COMPLETIONS_SUFFIX):
            return cls(base_url, path, chat=False)
        raise ConfigurationError(
            "endpoint", f"must end in /completions or /chat/completions, got {path}"
        )

    @classmethod
    def resolve(cls, base_url: str, path: str | None, backend: str | None) -> Endpoint:
        """`--endpoint` and `--backend` together: a missing path is the backend's
        (`openai-chat`: /v1/chat/completions, else /v1/completions); both given must agree."""
        if backend is not None and backend not in BACKENDS:
            raise ConfigurationError("backend", f"one of {sorted(BACKENDS)}, got {backend!r}")
        if path is None:
            path = "/v1/chat/completions" if backend and BACKENDS[backend] else "/v1/completions"
        endpoint = cls.parse(base_url, path)
        if backend is not None and BACKENDS[backend] != endpoint.chat:
            speaks = "chat completions" if BACKENDS[backend] else "completions"
            raise ConfigurationError(
                ("backend", "endpoint"),
                f"--backend {backend} sends {speaks} requests, but --endpoint {endpoint.path} "
                "takes the other kind; leave --endpoint out or make them agree",
            )
        return endpoint


@dataclass
class RequestResult:
    index: int
    start: float = 0.0  # seconds after the run started
    success: bool = False
    error_kind: str | None = None
    error: str = ""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    latency: float | None = None  # end-to-end
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int = 0  # usage.completion_tokens, else tokens_seen
    tokens_seen: int = 0  # tokens counted in chunks
    exact_token_count: bool = False  # every token chunk carried exit_depths
    usage_reported: bool = False
    exit_depths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_chunks: list[str] = field(default_factory=list)  # the streamed text, as it came

    @property
    def generated_text(self) -> str:
        return "".join(self.text_chunks)

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for failed or one-token requests."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def loops_per_token(self) -> float | None:
        decoded = self.exit_depths[1:]
        return sum(decoded) / len(decoded) if decoded else None


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares."""

    model: str
    temperature: float | None = 0.0
    top_p: float | None = None
    ignore_eos: bool = False
    exit_threshold: float | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body_extras(self) -> dict[str, Any]:
        """Fields outside the OpenAI API, sent through the client's `extra_body`."""
        extras: dict[str, Any] = {}
        if self.ignore_eos:
            extras["ignore_eos"] = True
        for name in ("exit_threshold", "min_loops", "max_loops"):
            if getattr(self, name) is not None:
                extras[name] = getattr(self, name)
        return {**extras, **self.extra_body}


def parse_extra_body(text: str | None) -> dict:
    """--extra-body: a JSON object merged into every request body."""
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError("extra_body", f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigurationError("extra_body", "must be a JSON object")
    return body


def error_kind(exc: BaseException) -> str:
    """A short, countable name: http_<status>, timeout, connection_error, stream_error, or the
    exception's type."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection_error"
    if isinstance(exc, openai.APIError):  # an error event inside a started stream
        return "stream_error"
    return type(exc).__name__


async def _open_stream(client, endpoint: Endpoint, request: BenchRequest, options: RequestOptions):
    common: dict[str, Any] = dict(
        model=options.model,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=options.body_extras() or None,
    )
    if options.temperature is not None:
        common["temperature"] = options.temperature
    if options.top_p is not None:
        common["top_p"] = options.top_p
    if endpoint.chat:
        return await client.chat.completions.create(
            messages=request.messages, max_completion_tokens=request.output_len, **common
        )
    return await client.completions.create(
        prompt=request.prompt, max_tokens=request.output_len, **common
    )


async def send_request(
    client,
    endpoint: Endpoint,
    request: BenchRequest,
    options: RequestOptions,
    result: RequestResult,
    run_start: float,
) -> RequestResult:
    """Send `request`, filling `result` as the stream goes (so a cancelled request still has
    what it measured). Errors are recorded in `result`, never raised; cancellation is."""
    sent = time.perf_counter()
    result.start = sent - run_start
    last = sent
    saw_depths, saw_plain = False, False
    try:
        stream = await _open_stream(client, endpoint, request, options)
        async with stream:  # closes the response however the loop ends
            async for chunk in stream:
                now = time.perf_counter()
                if getattr(chunk, "usage", None) is not None:
                    result.usage_reported = True
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    result.output_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices or ():
                    depths = (choice.model_extra or {}).get("exit_depths")
                    if endpoint.chat:
                        text = choice.delta.content if choice.delta is not None else None
                    else:
                        text = choice.text
                    if text:
                        result.text_chunks.append(text)
                    if depths:
                        tokens, saw_depths = len(depths), True
                        result.exit_depths.extend(depths)
                    else:
                        tokens = 1 if text else 0
                        saw_plain = saw_plain or tokens > 0
                    if tokens:
                        if result.ttft is None:
                            result.ttft = now - sent
                        else:
                            result.itls.append(now - last)
                        last = now
                        result.chunk_tokens.append(tokens)
                        result.tokens_seen += tokens
                    if choice.finish_reason is not None:
                        result.finish_reason = choice.finish_reason
            result.latency = time.perf_counter() - sent  # [DONE] read, before closing
        result.exact_token_count = saw_depths and not saw_plain
        if not result.usage_reported:
            result.output_tokens = result.tokens_seen
            result.prompt_tokens = request.prompt_len
        if result.finish_reason == "abort":
            result.error_kind, result.error = "aborted", "the server aborted the request"
        elif result.tokens_seen == 0:
            result.error_kind, result.error = "no_tokens", "the stream carried no token"
        else:
            result.success = True
    except asyncio.CancelledError:
        result.error_kind, result.error = "cancelled", "the benchmark was interrupted"
        raise
    except Exception as exc:  # every failure of one request is data, not a crash
        result.error_kind, result.error = error_kind(exc), f"{type(exc).__name__}: {exc}"
    return result
