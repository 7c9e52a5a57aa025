"""`CoreClient`: the `EngineClient` of a front end, over an engine core on another thread or in
another process (module M1).

Everything front-end happens on one asyncio event loop: submitting (`CoreAdd`, awaited until the
core answers), output processing (`OutputProcessor`: detokenization, stop strings, the shape
each consumer reads), streaming, and cancelling (`CoreAbort`). The core's `CoreOutputs` arrive
on that loop through a transport:

    event loop                                    transport            core
    ----------                                    ---------            ----
    submit_many -> processor.add, CoreAdd ------> send  ------------>  CoreLoop.handle
    _on_outputs(CoreOutputs) <------------------- deliver  <---------  one per round
      replies resolve submits; deltas go through the processor; each touched stream is woken;
      ids whose stop string matched go back as CoreAbort(STOP)
    stream(id): waits, takes what is new from its RequestState (nothing is merged or copied)
    stream_final(id): woken once, when the request ended; takes its whole output at once

Request identity (R17): a stream holds its `RequestState`, not an id, and `cancel` aborts only
while the state registered for the id is that stream's and unfinished, so a cancel that
arrives after the id was reused never touches the newer request.

If the core dies (`on_dead`), every live stream and pending call ends with `EngineDeadError`
and `dead` says why (the HTTP app turns that into 503 bodies or error events and a failing
/health); a stream first yields what arrived before the death. If applying one of the core's
deltas fails (a bug in this process, `_output_failed`), only that request's stream ends, at
once, with the exception (the HTTP app answers 500 `internal_error`), and the request is aborted
in the core; the other requests of the round go on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from rlt_contracts import (
    CoreAbort,
    CoreAdd,
    CoreOutputs,
    CorePDConnect,
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    RequestOutputDelta,
    raise_wire_error,
)

from rlt.engine.output_processor import OutputProcessor, RequestState

logger = logging.getLogger(__name__)


class _Stream:
    """Wake-ups of one request's consumer; the data stays in its `RequestState`.

    final_only: the consumer reads the request once, when it ended (FINAL), so it is not woken
    before; otherwise at every round that brought it something (DELTA)."""

    __slots__ = ("state", "wakeup", "failure", "broken", "abandoned", "final_only")

    def __init__(self, state: RequestState) -> None:
        self.state = state
        self.wakeup = asyncio.Event()
        self.failure: BaseException | None = None
        # its output could not be processed: `failure` is raised before anything else, and
        # the core's later deltas for it are ignored (it was aborted there)
        self.broken = False
        self.abandoned = False  # its reader stopped before the end (a client that left)
        self.final_only = False

    @property
    def open(self) -> bool:
        """The request runs in the core for this stream: it neither ended nor broke."""
        return not self.state.ended and not self.broken


class CoreClient:
    """`rlt_contracts.EngineClient` and `BatchSubmitter` over a core transport.

    The transport has `send(message)`, `close()`, and calls `on_outputs(CoreOutputs)` and
    `on_dead(error)` on the client's event loop. `stream()` claims the deltas of a successful
    submit once (right after it, or later: they wait).
    """

    def __init__(
        self,
        transport,
        *,
        model_info: ModelInfo,
        stats: EngineStats,
        tokenizer: Callable[[], object | None],
    ) -> None:
        self._transport = transport
        self._model_info = model_info
        self._stats = stats
        self._processor = OutputProcessor(tokenizer, model_info.eos_token_ids)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._streams: dict[str, _Stream] = {}  # live or unclaimed, by request id
        self._unclaimed: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._stopping = False

    # -- EngineClient --------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def dead(self) -> BaseException | None:
        """Why the core stopped (EngineDeadError), or None while it runs."""
        return self._dead

    async def submit(self, request: EngineRequest) -> None:
        await self.submit_many((request,))

    async def submit_many(self, requests: Sequence[EngineRequest]) -> None:
        """Queue every request in one core operation, all or none."""
        self._check_running()
        requests = tuple(requests)
        states = self._processor.add(requests)
        streams = [_Stream(state) for state in states]
        try:
            await self._call(lambda call_id: CoreAdd(call_id, requests))
        except asyncio.CancelledError:
            # the caller left while the core decided: it may have queued them; end them
            self._transport_send_quietly(CoreAbort(tuple(r.request_id for r in requests)))
            self._processor.drop(states)
            raise
        except BaseException:
            self._processor.drop(states)
            raise
        for stream in streams:
            self._streams[stream.state.request_id] = stream
            self._unclaimed[stream.state.request_id] = stream

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        """Claim the deltas of the latest accepted submit of `request_id` (once)."""
        return self._read(self._claim(request_id))

    def stream_final(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        """Claim `request_id` like `stream`, as a FINAL consumer (vLLM's
        RequestOutputKind.FINAL_ONLY; a non-streaming HTTP response): it is woken once, when
        the request ended, and reads one delta holding the whole output (tokens, exit depths,
        text, logprobs, prompt scores, finish reason, timings), or the failure."""
        stream = self._claim(request_id)
        stream.final_only = True
        return self._read(stream)

    def _claim(self, request_id: str) -> _Stream:
        stream = self._unclaimed.pop(request_id, None)
        if stream is None:
            raise InvalidRequestError(
                "request_id", f"no submitted, unclaimed request {request_id!r} to stream"
            )
        return stream

    async def _read(self, stream: _Stream) -> AsyncIterator[RequestOutputDelta]:
        state = stream.state
        try:
            while True:
                if stream.broken:
                    raise stream.failure
                if state.ended if stream.final_only else state.has_news():
                    delta = state.take()
                    yield delta
                    if delta.finished:
                        return
                    continue
                if stream.failure is None and self._dead is not None:
                    stream.failure = self._dead  # (it died before this stream was registered)
                if stream.failure is not None:
                    raise stream.failure
                stream.wakeup.clear()
                await stream.wakeup.wait()
        finally:
            stream.abandoned = True
            self._forget(stream)

    async def cancel(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.open and self._dead is None:
            self._transport_send_quietly(CoreAbort((request_id,)))

    async def refresh_stats(self) -> None:
        """Read the core's current statistics (`stats()` returns them after this): an add
        without requests, which the core answers before its next step, and every answer
        carries the statistics. Several front ends share one core, and a front end that sent
        nothing for a while holds older statistics than the others: a /metrics scrape reads
        fresh ones first, so successive scrapes never go back, whichever front end answers."""
        await self._call(lambda call_id: CoreAdd(call_id, ()))

    async def pd_connect(self, peers: Sequence[bytes]) -> list[list[str]]:
        """The PD transport connects `peers`: [connected, incompatible, failed]."""
        return await self._call(lambda call_id: CorePDConnect(call_id, tuple(peers)))

    async def shutdown(self) -> None:
        """Stop the core: what still runs ends with finish reason "abort"."""
        self._stopping = True
        await self._transport.close()

    def live_request_ids(self) -> list[str]:
        """Requests of this front end that have not ended."""
        return [r for r, stream in self._streams.items() if stream.open]

    async def wait_finished(self, request_ids, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until the core reported the end of these requests."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._dead is None and any(
            (s := self._streams.get(r)) is not None and s.open for r in request_ids
        ):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)

    # -- plumbing ------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    async def _call(self, make_message):
        self._check_running()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._transport.send(make_message(call_id))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _transport_send_quietly(self, message) -> None:
        if self._dead is None:
            try:
                self._transport.send(message)
            except EngineDeadError:
                pass  # the core's death ends every stream anyway

    def _forget(self, stream: _Stream) -> None:
        request_id = stream.state.request_id
        if self._streams.get(request_id) is stream and not stream.open:
            del self._streams[request_id]
            self._processor.drop((stream.state,))

    def on_outputs(self, outputs: CoreOutputs) -> None:
        """One round of the core (runs on the event loop): statistics first, then replies,
        then deltas, so a consumer that sees a delta never reads older statistics."""
        if outputs.stats is not None:
            self._stats = outputs.stats
        for reply in outputs.replies:
            future = self._calls.get(reply.call_id)
            if future is None or future.done():
                continue
            if reply.error is None:
                future.set_result(reply.result)
            else:
                try:
                    raise_wire_error(reply.error)
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)
        if not outputs.deltas:
            return
        touched, stopped = self._processor.process(outputs.deltas, self._output_failed)
        for state in touched:
            stream = self._streams.get(state.request_id)
            if stream is not None and stream.state is state:
                if stream.abandoned:
                    self._forget(stream)  # nobody reads it: drop it once it ended
                elif state.ended or not stream.final_only:
                    stream.wakeup.set()
        if stopped:
            self._transport_send_quietly(CoreAbort(tuple(stopped), FinishReason.STOP))

    def _output_failed(self, request_id: str, error: Exception) -> None:
        """One of the core's deltas for `request_id` could not be applied (a bug in this
        process): its stream ends with `error` at once, the core aborts the request (its KV is
        freed) and its later deltas are ignored."""
        logger.error("processing the output of request %s failed", request_id, exc_info=error)
        stream = self._streams.get(request_id)
        if stream is None or not stream.open:
            return
        stream.failure, stream.broken = error, True
        self._processor.drop((stream.state,))
        self._transport_send_quietly(CoreAbort((request_id,)))
        if stream.abandoned:
            self._forget(stream)
        else:
            stream.wakeup.set()

    def on_dead(self, error: BaseException) -> None:
        """The core is gone: fail every call and stream (runs on the event loop)."""
        if self._dead is not None:
            return
        self._dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._dead)
        for stream in self._streams.values():
            if stream.open:
                stream.failure = self._dead
                stream.wakeup.set()
