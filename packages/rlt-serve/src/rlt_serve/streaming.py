"""Server-sent events: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

A stream that fails after it started (the engine died, or failed on this request) sends one
`data: {"error": {...}}` event (the OpenAI client raises it as an APIError) and then [DONE].
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from rlt_contracts import RequestOutputDelta
from starlette.types import Receive, Scope, Send

from rlt_serve.errors import APIError, from_engine_error, sse_error_event
from rlt_serve.generation import Choice, Generation

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ChunkBuilder = Callable[[Choice, RequestOutputDelta], Iterable[BaseModel]]


def sse(chunk: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(chunk, BaseModel):
        data = chunk.model_dump_json(exclude_none=False)
    else:
        data = json.dumps(chunk)
    return f"data: {data}\n\n".encode()


class GenerationStreamResponse(StreamingResponse):
    """An SSE response that owns a started `Generation`: however the response ends (finished,
    client gone, cancelled, failed, or never iterated), its unfinished engine requests are
    cancelled."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._generation = generation
        generation.streaming = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: BaseException | None = None
        try:
            await super().__call__(scope, receive, send)
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._generation.__aexit__(type(error) if error else None, error, None)


def stream_generation(
    generation: Generation,
    *,
    opening: Iterable[BaseModel],
    chunks: ChunkBuilder,
    closing: Callable[[], Iterable[BaseModel]],
) -> GenerationStreamResponse:
    """SSE response: `opening` chunks, one or more chunks per delta, `closing` chunks, [DONE].
    `generation` was entered (submitted, and watching its client's disconnect)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in opening:
                yield sse(chunk)
            async for choice, delta in generation.deltas():
                for chunk in chunks(choice, delta):
                    yield sse(chunk)
            failure = generation.failure()
            if failure is not None:
                yield sse_error_event(failure)
            else:
                for chunk in closing():
                    yield sse(chunk)
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            error = exc if isinstance(exc, APIError) else from_engine_error(exc)
            generation.record_error(error)
            yield sse_error_event(error)
        yield DONE

    return GenerationStreamResponse(events(), generation)
