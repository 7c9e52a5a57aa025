"""`RayEngineClient`: the `rlt_contracts.EngineClient` that rlt-serve's app runs on in the
ingress, over a Ray Serve handle to the engine replicas.

    submit(request)  generate.remote(request) through the handle: the router picks the replica;
                     the stream's first item answers the submit (Accepted, or Rejected with
                     the engine's own error, raised here as on a single engine)
    stream(id)       the replica's deltas, unchanged
    cancel(id)       cancels the Ray call: the replica aborts the request in its engine
    shutdown()       refuses new requests (503) and aborts those in flight: each stream ends
                     with a final delta of finish_reason "abort" and no error (what was
                     generated is kept), as `rlt serve` ends them at shutdown
    stats()          the replicas' last reported statistics, added up (a lost replica's
                     counters stay in the sum, its gauges leave it)

Failures (README.md, "Contracts" and "Failures"): a replica lost after submit ends its
requests' streams with `EngineDeadError` naming it (`dead` stays None: /health follows the
service, not one replica); a submit whose replica died before accepting is tried again on
another (`SUBMIT_ATTEMPTS`: nothing ran there); no answer within `submit_timeout_s` is an
`OverloadedError` (429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from rlt_contracts import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    ModelInfo,
    OverloadedError,
    RequestOutputDelta,
    RltError,
    raise_wire_error,
)
from rlt_serve.request_table import RequestTable

from rlt_ray.wire import Accepted, Finished, Rejected, sum_stats

logger = logging.getLogger(__name__)

SUBMIT_ATTEMPTS = 3
MAX_TRACKED_REPLICAS = 1024  # statistics kept per replica (a long-lived ingress sees restarts)


class ReplicaLostError(RltError, RuntimeError):
    """The replica serving a request went away before answering its submit."""


@dataclass
class _Flow:
    request: EngineRequest
    generator: object  # ray.serve.handle.DeploymentResponseGenerator
    replica: str
    claimed: bool = False
    finished: bool = False
    aborted: bool = False  # ended by shutdown(): its end is an abort, not a failure


class RayEngineClient:
    def __init__(self, handle, model_info: ModelInfo, *, submit_timeout_s: float = 60.0) -> None:
        self._handle = handle.options(stream=True)
        self._model_info = model_info
        self.submit_timeout_s = submit_timeout_s
        self._flows: RequestTable[_Flow] = RequestTable()
        self._replica_stats: dict[str, EngineStats] = {}
        self._stopping = False

    # -- EngineClient ---------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def dead(self) -> BaseException | None:
        """Why nothing can be served (drives /health): only after shutdown. A lost replica is
        one request's failure, not the service's."""
        return EngineDeadError("the server is shutting down") if self._stopping else None

    def stats(self) -> EngineStats:
        return sum_stats(list(self._replica_stats.values()))

    def replica_stats(self) -> dict[str, EngineStats]:
        return dict(self._replica_stats)

    async def submit(self, request: EngineRequest) -> None:
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        self._flows.check_free(request.request_id)
        last_error: BaseException | None = None
        for _ in range(SUBMIT_ATTEMPTS):
            generator = self._handle.generate.remote(request)
            try:
                first = await asyncio.wait_for(anext(generator), self.submit_timeout_s)
            except TimeoutError:
                generator.cancel()
                raise OverloadedError(
                    f"no engine replica answered within {self.submit_timeout_s:g} s"
                ) from None
            except asyncio.CancelledError:
                generator.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - a replica lost before it accepted
                generator.cancel()
                last_error = exc
                logger.warning("submit of %s: replica lost (%s); retrying", request.request_id, exc)
                continue
            if isinstance(first, Rejected):
                raise_wire_error(first.error)
            if not isinstance(first, Accepted):
                generator.cancel()
                raise RltError(f"unexpected first item from an engine replica: {first!r}")
            self._note_stats(first.replica, first.stats)
            flow = _Flow(request, generator, first.replica)
            self._flows[request.request_id] = flow
            if self._stopping:  # shutdown() ran while this submit waited: abort it too
                flow.aborted = True
                generator.cancel()
            return
        raise ReplicaLostError(f"engine replicas were lost before accepting: {last_error}")

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        return self._deltas(self._flows.claim(request_id))

    async def cancel(self, request_id: str) -> None:
        flow = self._flows.get(request_id)
        if flow is not None and not flow.finished:
            flow.generator.cancel()

    async def shutdown(self) -> None:
        self._stopping = True
        for flow in list(self._flows.values()):
            if not flow.finished:
                flow.aborted = True
                flow.generator.cancel()

    # -- plumbing -------------------------------------------------------------------------------
    async def _deltas(self, flow: _Flow) -> AsyncIterator[RequestOutputDelta]:
        try:
            cause = None
            try:
                async for item in flow.generator:
                    if isinstance(item, Finished):
                        self._note_stats(flow.replica, item.stats)
                        continue
                    if isinstance(item, RequestOutputDelta):
                        yield item
                        if item.finished:
                            flow.finished = True
                if not flow.finished:
                    cause = "its stream ended without a final delta"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the replica or the call was lost
                cause = None if flow.finished else _describe(exc)
            if cause is not None:
                flow.finished = True
                if flow.aborted:
                    yield self._aborted(flow)
                else:
                    raise self._lost(flow, cause)
        finally:
            if not flow.finished:
                flow.generator.cancel()  # the reader left: the replica aborts the request
            self._flows.forget(flow.request.request_id, flow)

    def _aborted(self, flow: _Flow) -> RequestOutputDelta:
        """The final delta of a flow that shutdown() ended: an abort, what it generated kept."""
        return RequestOutputDelta(
            request_id=flow.request.request_id,
            token_ids=(),
            exit_depths=(),
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=len(flow.request.prompt_token_ids),
        )

    def _lost(self, flow: _Flow, cause: str) -> EngineDeadError:
        """What a flow's stream raises when its replica went away: an `EngineDeadError` (503
        `engine_unavailable`) naming the replica and the cause."""
        self._replica_gone(flow.replica)
        message = f"lost engine replica {flow.replica}: {cause}"
        logger.warning("request %s failed: %s", flow.request.request_id, message)
        return EngineDeadError(message)

    def _replica_gone(self, replica: str) -> None:
        """Its counters stay in the sum (they stay monotonic); its gauges no longer count."""
        stats = self._replica_stats.get(replica)
        if stats is not None:
            self._replica_stats[replica] = msgspec.structs.replace(
                stats, running_requests=0, waiting_requests=0, kv_blocks_total=0, kv_blocks_used=0
            )

    def _note_stats(self, replica: str, stats: EngineStats) -> None:
        self._replica_stats.pop(replica, None)
        self._replica_stats[replica] = stats
        while len(self._replica_stats) > MAX_TRACKED_REPLICAS:
            self._replica_stats.pop(next(iter(self._replica_stats)))


def _describe(exc: BaseException) -> str:
    """One line about why a Ray call failed (Ray's messages span many lines)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300]
