"""Server-sent events: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

A stream that fails after it started ends exactly like a finished one (each open choice's last
chunk with finish_reason "abort", the usage chunk if asked for), plus one error event before
`[DONE]`, whatever failed (README.md, the end of "Worked example"; docs/serving.md, "What a
client sees when something fails"). The error event and `[DONE]` always go out, even when the
choice or usage chunks cannot be built.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from rlt_contracts import RequestOutputDelta, RltError
from starlette.types import Receive, Scope, Send

from rlt_serve.errors import APIError, from_engine_error, sse_error_event
from rlt_serve.generation import Choice, Generation

logger = logging.getLogger("rlt_serve")

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
    """SSE response: `opening` chunks, one or more chunks per delta, `closing` chunks, [DONE]
    (on a failure: see the module docstring). `generation` was entered (submitted, and
    watching its client's disconnect)."""

    async def events() -> AsyncIterator[bytes]:
        ended: set[int] = set()  # choices whose last chunk (finish_reason) went out
        try:
            for chunk in opening:
                yield sse(chunk)
            async for choice, delta in generation.deltas():
                for chunk in chunks(choice, delta):
                    yield sse(chunk)
                if delta.finished:
                    ended.add(choice.index)
            failure = generation.failure()
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            failure = _api_error(exc)
            generation.record_error(failure)
        if failure is None:
            for chunk in closing():
                yield sse(chunk)
        else:
            ends = await generation.abort_open_choices(ended)
            for event in _failed_ending(ends, chunks, closing):
                yield event
            yield sse_error_event(failure)
        yield DONE

    return GenerationStreamResponse(events(), generation)


def _api_error(exc: Exception) -> APIError:
    """The error event of a stream that raised `exc`: an engine error keeps its meaning (a dead
    engine is 503 engine_unavailable); anything else is a bug here, logged."""
    if isinstance(exc, APIError):
        return exc
    if not isinstance(exc, RltError):
        logger.error("a stream failed while building its chunks", exc_info=exc)
    return from_engine_error(exc)


def _failed_ending(
    ends: list[tuple[Choice, RequestOutputDelta]],
    chunks: ChunkBuilder,
    closing: Callable[[], Iterable[BaseModel]],
) -> list[bytes]:
    """A failed stream's last chunks before its error event: the last chunk of each choice that
    was still open (`ends`: finish_reason "abort"), then the closing (usage) chunks. Built all
    at once, so a builder that fails (the bug that failed the stream) sends none of them rather
    than half."""
    try:
        events = [sse(chunk) for choice, end in ends for chunk in chunks(choice, end)]
        events += [sse(chunk) for chunk in closing()]
    except Exception:  # noqa: BLE001 - the error event still goes out
        logger.exception("a failed stream's closing chunks could not be built")
        return []
    return events
