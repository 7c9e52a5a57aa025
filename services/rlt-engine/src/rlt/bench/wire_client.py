"""The benchmark's HTTP client: OpenAI's wire format without the SDK's cost per request.

The official `openai` client transforms a request body element by element before sending it
(a 1,024-token prompt given as token ids: 9 ms of Python on a 2-core CPU) and builds a pydantic
model per stream chunk (75 us). At 128 concurrent streams that made the benchmark, not the
server, set the pace: when a wave of requests ends, the next 128 went out one after the other
for over a second (H200, docs/results.md, issue 23). This client sends the same JSON (one
`json.dumps`), reads the server-sent events itself (one `json.loads` per chunk), and raises the
SDK's exception types, so measuring and error kinds (`request.send_request`) are unchanged.

    client.completions.create(**body)        -> async context manager and iterator of chunks
    client.chat.completions.create(**body)   -> the same for chat
    await client.list_models()               -> the cards of GET /models, as dicts

`body` takes the SDK's keyword arguments (`extra_body` is merged in, as the SDK does). A chunk
has `choices` (each with `text`, `delta.content`, `finish_reason`, and `model_extra`: the
choice's fields, so rlt's `exit_depths` is there) and `usage` (or None). Connections come from
`openai.DefaultAsyncHttpxClient` (up to 1,000, as the SDK's), with its timeout and proxies
(`--trust-env`). An https server's certificate is checked against `SSL_CERT_FILE` /
`SSL_CERT_DIR` when set, with or without `--trust-env`, as `vllm bench serve`'s client (aiohttp
on OpenSSL's defaults) does: a server with a self-signed certificate is benchmarked with
`SSL_CERT_FILE=cert.pem`.
"""

from __future__ import annotations

import json
import os
import ssl
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx  # what `openai.DefaultAsyncHttpxClient` is built on (openai >= 3)
import openai
from rlt_contracts import ConfigurationError

CERTIFICATE_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR")


def trusted_certificates() -> ssl.SSLContext | bool:
    """httpx's `verify`: the authorities of `SSL_CERT_FILE` / `SSL_CERT_DIR` when either is set
    (httpx reads them only when it also takes proxies from the environment), else httpx's
    default (True). One that does not load is a `ConfigurationError`."""
    given = {name: os.environ[name] for name in CERTIFICATE_VARIABLES if os.environ.get(name)}
    if not given:
        return True
    try:
        return ssl.create_default_context(
            cafile=given.get("SSL_CERT_FILE"), capath=given.get("SSL_CERT_DIR")
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(tuple(given), f"cannot load the certificates: {exc}") from None


class WireClient:
    def __init__(self, api_base: str, *, api_key: str, timeout: float, trust_env: bool) -> None:
        self._base = api_base.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._http = openai.DefaultAsyncHttpxClient(
            trust_env=trust_env, timeout=timeout, verify=trusted_certificates()
        )
        self.completions = SimpleNamespace(create=self._creator("/completions"))
        chat = SimpleNamespace(create=self._creator("/chat/completions"))
        self.chat = SimpleNamespace(completions=chat)

    async def __aenter__(self) -> WireClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._http.aclose()

    async def list_models(self) -> list[dict]:
        request = self._http.build_request("GET", self._base + "/models", headers=self._headers)
        response = await self._send(request)
        try:
            await response.aread()
            _raise_for_status(response)
            return list(response.json().get("data", []))
        finally:
            await response.aclose()

    def _creator(self, path: str):
        async def create(**kwargs) -> _EventStream:
            body = {k: v for k, v in kwargs.items() if k != "extra_body" and v is not None}
            body.update(kwargs.get("extra_body") or {})
            request = self._http.build_request(
                "POST",
                self._base + path,
                content=json.dumps(body).encode(),
                headers={
                    **self._headers,
                    "Content-Type": "application/json",
                    "Accept": "text/event-stream",
                },
            )
            return _EventStream(self, request)

        return create

    async def _send(self, request):
        """The response with its body not yet read; transport failures as the SDK's types."""
        try:
            return await self._http.send(request, stream=True)
        except httpx.TimeoutException:
            raise openai.APITimeoutError(request=request) from None
        except httpx.TransportError as error:
            raise openai.APIConnectionError(message=str(error), request=request) from None


class _EventStream:
    """One streaming response: opened on `async with`, closed however its loop ends."""

    def __init__(self, client: WireClient, request) -> None:
        self._client, self._request, self._response = client, request, None

    async def __aenter__(self) -> _EventStream:
        self._response = await self._client._send(self._request)
        if self._response.status_code >= 400:
            try:
                await self._response.aread()
                _raise_for_status(self._response)
            finally:
                await self._response.aclose()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._response.aclose()

    async def __aiter__(self):
        try:
            async for line in self._response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # comments, event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:  # an error event inside a started stream
                    message = str(event["error"].get("message", event["error"]))
                    raise openai.APIError(message, self._request, body=event)
                yield _chunk(event)
        except httpx.TimeoutException:
            raise openai.APITimeoutError(request=self._request) from None
        except httpx.TransportError as error:
            raise openai.APIConnectionError(message=str(error), request=self._request) from None


def _chunk(event: dict[str, Any]) -> SimpleNamespace:
    choices = []
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        choices.append(
            SimpleNamespace(
                text=choice.get("text"),
                delta=None if delta is None else SimpleNamespace(content=delta.get("content")),
                finish_reason=choice.get("finish_reason"),
                model_extra=choice,
            )
        )
    usage = event.get("usage")
    return SimpleNamespace(
        choices=choices,
        usage=None
        if usage is None
        else SimpleNamespace(
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        ),
    )


def _raise_for_status(response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else str(body)
    raise openai.APIStatusError(
        f"Error code: {response.status_code} - {message}", response=response, body=body
    )
