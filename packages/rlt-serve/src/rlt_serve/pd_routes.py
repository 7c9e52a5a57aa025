"""The internal PD endpoints of an engine instance (`rlt_contracts.pd_wire` describes the
protocol): what a PD coordinator calls to admit, connect and drive the instance.

    GET  /internal/pd/info      InstanceInfo (role, agent, metadata, compatibility, load)
    POST /internal/pd/connect   ConnectBody -> ConnectReply | 409 pd_incompatible
    POST /internal/pd/generate  GenerateBody -> NDJSON StreamLines (see pd_wire)

They sit behind the same guards as /v1/* (API key, Host, body limit). A generate request is
an ordinary engine request: errors before its stream starts answer like the OpenAI endpoints
(400 naming the field, 429, 503); closing the connection aborts it on the engine.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from rlt_contracts import (
    EngineClient,
    FinishReason,
    KVTransferParams,
    PDControl,
    PDRole,
    RequestOutputDelta,
)
from rlt_contracts.pd_wire import (
    CONNECT_PATH,
    GENERATE_PATH,
    INFO_PATH,
    NDJSON,
    ConnectBody,
    ConnectReply,
    GenerateBody,
    PDIncompatibleError,
    StreamError,
    StreamLine,
)

from rlt_serve.errors import APIError, from_engine_error, invalid

_encode = msgspec.json.Encoder().encode


def add_pd_routes(app: FastAPI, client: EngineClient, control: PDControl) -> None:
    @app.get(INFO_PATH, include_in_schema=False)
    async def pd_info() -> Response:
        return Response(_encode(control.info()), media_type="application/json")

    @app.post(CONNECT_PATH, include_in_schema=False)
    async def pd_connect(request: Request) -> Response:
        body = _decode(await request.body(), ConnectBody)
        peers = []
        for index, text in enumerate(body.peers):
            try:
                peers.append(base64.b64decode(text, validate=True))
            except (binascii.Error, ValueError):
                raise invalid(f"peers[{index}]", "not base64 transport metadata") from None
        try:
            connected = await control.connect(peers)
        except PDIncompatibleError as exc:
            raise APIError(409, str(exc), param="peers", code="pd_incompatible") from exc
        return Response(_encode(ConnectReply(connected)), media_type="application/json")

    @app.post(GENERATE_PATH, include_in_schema=False)
    async def pd_generate(request: Request) -> StreamingResponse:
        body = _decode(await request.body(), GenerateBody)
        params = body.kv_transfer_params
        engine_request = msgspec.structs.replace(
            body.request, kv_transfer=params if params.role is not PDRole.NONE else None
        )
        try:
            await client.submit(engine_request)
        except Exception as exc:
            raise from_engine_error(exc) from exc
        deltas = client.stream(engine_request.request_id)
        return _RequestStream(client, engine_request.request_id, deltas, params)


class _RequestStream(StreamingResponse):
    """One engine request's stream lines. However the response ends before the request did
    (the client went away, even before the first line was read from the engine), the request
    is aborted on the engine: the check is here, not in the lines' generator, whose cleanup
    never runs when it is closed before it started."""

    def __init__(
        self,
        client: EngineClient,
        request_id: str,
        deltas: AsyncIterator[RequestOutputDelta],
        params: KVTransferParams,
    ) -> None:
        self._client, self._request_id = client, request_id
        self._finished = False
        super().__init__(self._lines(deltas, params.role, params.transfer_id), media_type=NDJSON)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._finished:
                with anyio.CancelScope(shield=True):
                    await self._client.cancel(self._request_id)

    async def _lines(
        self, deltas: AsyncIterator[RequestOutputDelta], role: PDRole, transfer_id: str
    ) -> AsyncIterator[bytes]:
        async for delta in deltas:
            self._finished = delta.finished
            if delta.kv_target is not None:
                yield _line(StreamLine(target=delta.kv_target))
                delta = msgspec.structs.replace(delta, kv_target=None)
                if not (delta.token_ids or delta.text or delta.finished):
                    continue
            if role is PDRole.PREFILL:
                if delta.finished:  # P makes no tokens: only its outcome goes out
                    yield _line(_prefill_outcome(delta, transfer_id))
                continue
            yield _line(StreamLine(delta=delta))


def _prefill_outcome(delta: RequestOutputDelta, transfer_id: str) -> StreamLine:
    if delta.finish_reason is FinishReason.STOP and not delta.error:
        return StreamLine(done={"transfer_id": transfer_id})
    message = delta.error or "the prefill instance aborted the request"
    return StreamLine(error=StreamError(message=message, code="kv_transfer_failed"))


def _line(line: StreamLine) -> bytes:
    return _encode(line) + b"\n"


def _decode(content: bytes, kind: type):
    try:
        return msgspec.json.decode(content, type=kind)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("at `$.")[2].rstrip("`") or None
        raise invalid(path, f"invalid {kind.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise invalid(None, f"malformed JSON body: {exc}") from None
