"""`AsyncEngine`: the `EngineClient` of one local `LLMEngine`, for asyncio frontends (module M1/M2).

`LLMEngine` is synchronous and not thread-safe, so exactly one thread, the engine thread, ever
touches it. The event loop talks to that thread through a command queue and hears back through
per-request streams:

    event loop                               engine thread
    ----------                               -------------
    submit_many --_Submit(reqs, future)->    engine.add_requests -> future result / exception
    (submit(req) is submit_many([req]))
    cancel(id)  --_Cancel(stream)------->    engine.abort_request -> final "abort" delta
    shutdown()  --_Shutdown------------->    abort everything, publish, exit
                <--call_soon_threadsafe--    engine.step() -> deltas -> _Stream.push

The engine thread blocks on the queue while no request is unfinished (no busy spin) and
otherwise drains every pending command before each `step()`, so commands never wait for more
than one step.

Request identity (R17): the engine thread keeps the `_Stream` object of every live request.
Deltas go to the stream registered for the request at that moment, and a `_Cancel` names the
stream it means, not just the id: a cancel that arrives after the request finished and its id
was submitted again is a no-op instead of aborting the new request.

Statistics are computed on the engine thread after every command batch and step, and published
as one immutable `EngineStats` object (a single reference assignment), so `stats()` is a cheap
and consistent read from any thread. They are published before the deltas of the same round
are handed to the event loop, so a consumer that has seen a delta (e.g. the final "abort")
never reads older statistics (e.g. the aborted request's KV blocks still in use).

If the engine thread fails, every live stream ends with the error, pending and later `submit`s
raise `EngineDeadError`, and `dead` says why; nothing restarts the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from rlt_contracts import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    RequestOutputDelta,
)

from rlt.engine.llm_engine import LLMEngine
from rlt.engine.outputs import RequestOutput
from rlt.serving.deltas import OutputCursor, merge_deltas

logger = logging.getLogger(__name__)


class _Stream:
    """Deltas of one submitted request, consumed on the event loop that submitted it.

    `push` runs on that loop (the engine thread schedules it with call_soon_threadsafe).
    Deltas that pile up while the consumer is slow are merged on read, so a slow reader costs
    memory proportional to its output, never a growing number of events.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        on_finished: Callable[[_Stream], None],
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self._on_finished = on_finished
        self._pending: deque[RequestOutputDelta] = deque()
        self._wakeup = asyncio.Event()
        self._failure: BaseException | None = None
        self.finished = False  # the final delta (or a failure) was pushed

    def push(self, delta: RequestOutputDelta) -> None:
        if self.finished:
            return
        self._pending.append(delta)
        self._wakeup.set()
        if delta.finished:
            self._finish()

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._failure = error
        self._wakeup.set()
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self._on_finished(self)

    async def deltas(self) -> AsyncIterator[RequestOutputDelta]:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._pending:
                merged = self._pending.popleft()
                while self._pending:
                    merged = merge_deltas(merged, self._pending.popleft())
                yield merged
                if merged.finished:
                    return
            if self._failure is not None:
                raise self._failure


@dataclass(frozen=True)
class _Submit:
    """Several requests queued at once, all or none (one future for the batch)."""

    requests: tuple[EngineRequest, ...]
    streams: tuple[_Stream, ...]
    accepted: concurrent.futures.Future


@dataclass(frozen=True)
class _Cancel:
    stream: _Stream


@dataclass(frozen=True)
class _Call:
    function: Callable[[LLMEngine], object]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _Shutdown:
    pass


class AsyncEngine:
    """`rlt_contracts.EngineClient` over a local `LLMEngine` running on its own thread.

    The caller hands over the engine: from then on only the engine thread may use it.
    `stream()` claims the deltas of a successful `submit()` and must be called once for it
    (right after submit, or later: deltas wait); they arrive in order and the last one has
    `finished=True`. Deltas that wait unclaimed are kept until the id is submitted again.
    """

    def __init__(self, engine: LLMEngine, *, thread_name: str = "rlt-engine") -> None:
        self._engine = engine
        self._grammars = engine.parts.constraint_compiler  # thread-safe; None: no grammars
        self._model_info = engine.model_info()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: EngineStats = engine.get_stats()
        # event-loop side: streams of accepted submits not yet claimed by stream(), and the
        # stream of every unfinished request (what cancel() aims at)
        self._unclaimed: dict[str, _Stream] = {}
        self._active: dict[str, _Stream] = {}
        # engine-thread side: live requests
        self._live: dict[str, _Stream] = {}
        self._cursors: dict[str, OutputCursor] = {}
        self._outbox: list[tuple[_Stream, RequestOutputDelta]] = []
        self._dead: BaseException | None = None
        self._stopping = False
        self._lock = threading.Lock()  # orders `_stopping`/`_dead` with command submission
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- EngineClient --------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def dead(self) -> BaseException | None:
        """Why the engine stopped (an EngineDeadError after shutdown), or None while it runs."""
        return self._dead

    @property
    def stopped(self) -> bool:
        """The engine thread has ended: the engine may be used (or shut down) directly again."""
        return not self._thread.is_alive()

    async def submit(self, request: EngineRequest) -> None:
        await self.submit_many((request,))

    async def submit_many(self, requests: Sequence[EngineRequest]) -> None:
        """Queue every request in one engine-thread command, all or none
        (`rlt_contracts.BatchSubmitter`)."""
        loop = asyncio.get_running_loop()
        requests = tuple(requests)
        await self._compile_grammars(requests)
        streams = tuple(_Stream(r.request_id, loop, self._forget) for r in requests)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Submit(requests, streams, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine thread was deciding: if it accepted the
            # requests, nobody will ever consume them, so abort them.
            def abort_if_accepted(future: concurrent.futures.Future) -> None:
                if not future.cancelled() and future.exception() is None:
                    for stream in streams:
                        self._send_quietly(_Cancel(stream))

            accepted.add_done_callback(abort_if_accepted)
            raise
        for stream in streams:
            self._unclaimed[stream.request_id] = stream
            if not stream.finished:  # (a very short request may be over already)
                self._active[stream.request_id] = stream

    async def _compile_grammars(self, requests: Sequence[EngineRequest]) -> None:
        """Structured output: compile each distinct grammar on a worker thread (about 0.1 s
        for a new JSON schema), so the engine thread finds it in the compiler's cache instead
        of stalling every running request. An invalid grammar raises InvalidRequestError here,
        before anything is queued."""
        specs = {r.sampling.structured_output for r in requests} - {None}
        if self._grammars is not None:
            for spec in specs:
                await asyncio.to_thread(self._grammars.compile_grammar, spec)

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        """Claim the deltas of the latest accepted submit of `request_id` (once)."""
        stream = self._unclaimed.pop(request_id, None)
        if stream is None:
            raise InvalidRequestError(
                "request_id", f"no submitted, unclaimed request {request_id!r} to stream"
            )
        return stream.deltas()

    async def cancel(self, request_id: str) -> None:
        stream = self._active.get(request_id)
        if stream is not None and not stream.finished:
            self._send_quietly(_Cancel(stream))

    def _forget(self, stream: _Stream) -> None:
        """A stream got its final delta: cancel() has nothing left to aim at."""
        if self._active.get(stream.request_id) is stream:
            del self._active[stream.request_id]

    async def call(self, function: Callable[[LLMEngine], object]):
        """Run `function(engine)` on the engine thread between two steps and return its result
        (or raise its exception): the way to use parts only that thread may touch, such as a
        PD instance's transport."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(function, done))
        return await asyncio.wrap_future(done)

    async def shutdown(self) -> None:
        self._begin_shutdown()
        await asyncio.to_thread(self._thread.join)

    def close(self, timeout: float | None = None) -> None:
        """Synchronous `shutdown()` for callers without an event loop (idempotent)."""
        self._begin_shutdown()
        self._thread.join(timeout)

    # -- event-loop side helpers ---------------------------------------------------------------
    def _send(self, command) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is not running: {self._dead}")
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            self._commands.put(command)

    def _send_quietly(self, command) -> None:
        try:
            self._send(command)
        except EngineDeadError:
            pass  # shutdown or death already ends every stream

    def _begin_shutdown(self) -> None:
        with self._lock:
            if self._stopping or self._dead is not None:
                return
            self._stopping = True
            self._commands.put(_Shutdown())

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self._engine.has_unfinished_requests()
                for command in self._take_commands(block=idle):
                    if isinstance(command, _Shutdown):
                        self._abort_all()
                        self._publish()
                        self._mark_dead(EngineDeadError("the engine was shut down"))
                        return
                    self._handle(command)
                if self._engine.has_unfinished_requests():
                    self._deliver(self._engine.step())
                self._publish()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine
            logger.exception("engine thread failed")
            self._mark_dead(EngineDeadError(f"engine thread failed: {exc!r}"))

    def _take_commands(self, *, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command) -> None:
        if isinstance(command, _Submit):
            if not command.accepted.set_running_or_notify_cancel():
                return
            try:
                self._engine.add_requests(command.requests)
            except BaseException as exc:  # noqa: BLE001 - reported to the submitter
                command.accepted.set_exception(exc)
                return
            for request, stream in zip(command.requests, command.streams, strict=True):
                self._live[request.request_id] = stream
                self._cursors[request.request_id] = OutputCursor(
                    request.sampling.stop,
                    include_stop_str_in_output=request.sampling.include_stop_str_in_output,
                )
            command.accepted.set_result(None)
        elif isinstance(command, _Call):
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.function(self._engine))
                except BaseException as exc:  # noqa: BLE001 - reported to the caller
                    command.done.set_exception(exc)
        elif isinstance(command, _Cancel):
            request_id = command.stream.request_id
            if self._live.get(request_id) is not command.stream:
                return  # finished already, or the id now belongs to a newer request
            output = self._engine.abort_request(request_id)
            if output is not None:
                self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._live.get(output.request_id)
            if stream is None:
                continue
            delta = self._cursors[output.request_id].advance(output)
            if output.finished:
                del self._live[output.request_id]
                del self._cursors[output.request_id]
            if delta is not None:
                self._outbox.append((stream, delta))

    def _abort_all(self) -> None:
        for request_id in list(self._live):
            output = self._engine.abort_request(request_id)
            if output is not None:
                self._deliver([output])
        for request_id, stream in list(self._live.items()):  # unknown to the engine: end anyway
            self._outbox.append((stream, _final_abort(request_id)))
        self._live.clear()
        self._cursors.clear()

    def _publish(self) -> None:
        """Statistics first, then this round's deltas (see the module docstring)."""
        self._stats = self._engine.get_stats()
        outbox, self._outbox = self._outbox, []
        for stream, delta in outbox:
            _call_on_loop(stream, stream.push, delta)

    def _mark_dead(self, error: EngineDeadError) -> None:
        with self._lock:
            self._dead = error
        self._outbox.clear()  # a failed round's deltas are not delivered; the streams fail
        for stream in self._live.values():
            _call_on_loop(stream, stream.fail, error)
        self._live.clear()
        self._cursors.clear()
        while True:  # fail submits that raced with the failure
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)
            elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)


def _final_abort(request_id: str) -> RequestOutputDelta:
    return RequestOutputDelta(
        request_id=request_id,
        token_ids=(),
        exit_depths=(),
        finished=True,
        finish_reason=FinishReason.ABORT,
    )


def _call_on_loop(stream: _Stream, callback, argument) -> None:
    try:
        stream.loop.call_soon_threadsafe(callback, argument)
    except RuntimeError:
        pass  # the consumer's event loop is closed: nobody is listening any more
