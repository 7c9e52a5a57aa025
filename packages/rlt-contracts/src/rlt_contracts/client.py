"""`EngineClient`: the only interface a frontend (HTTP server, CLI) uses to talk to an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from rlt_contracts.outputs import EngineRequest, EngineStats, ModelInfo, RequestOutputDelta


@runtime_checkable
class EngineClient(Protocol):
    """Asynchronous engine access, safe to call from one asyncio event loop.

    submit: validate and enqueue a request; raises `InvalidRequestError` (or its subclass
      `CapacityError`) at once for bad input, and `OverloadedError`-style `RltError`s when the
      waiting queue is full. The request id must not be in use.
    stream: yields the request's deltas in order; the last one has `finished=True`.
    cancel: aborts the request if it is still running (a no-op otherwise); its KV blocks are freed
      and its stream ends with finish reason "abort".
    stats / model_info: cheap snapshots.
    shutdown: stops accepting requests, aborts what is in flight and stops the engine.
    """

    def model_info(self) -> ModelInfo: ...

    async def submit(self, request: EngineRequest) -> None: ...

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]: ...

    async def cancel(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class BatchSubmitter(Protocol):
    """Optional `EngineClient` capability: submit several requests at once (one HTTP request
    with a list of prompts), all or none.

    submit_many: validate and enqueue every request in one engine operation; on any error
      (`InvalidRequestError` for one of them, `OverloadedError` when the waiting queue cannot
      take them all) none was queued. Each accepted request is then streamed and cancelled by
      its id, as after `submit`. Frontends fall back to one `submit` per request for clients
      without it.
    """

    async def submit_many(self, requests: Sequence[EngineRequest]) -> None: ...
