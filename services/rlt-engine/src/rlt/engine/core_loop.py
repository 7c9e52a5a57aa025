"""`CoreLoop`: the engine core's side of the front-end boundary (M2).

It applies `CoreInput` messages to one `EngineCore`, steps it while requests are unfinished,
and sorts the results into one `CoreOutputs` per front end (the one that added each request).
The transport around it (a thread with queues, or a process with ZeroMQ) only moves messages:

    while running:
        for each message waiting (block while idle):   loop.handle(client, message)
        if loop.has_replies: send loop.take_outputs()  # answers go out before the step
        loop.step()                                    # one engine step if there is work
        for client, outputs in loop.take_outputs():    send(client, outputs)

Grammars (structured output) are compiled on a worker thread before their requests reach the
scheduler, so a new JSON schema (about 0.1 s to compile) never stalls the running requests;
the add is answered when its requests are queued. A request aborted while its grammar compiles
is queued and then aborted at once, so it still ends with a final delta.

Every round's outputs carry the core's statistics after it. An add without requests is answered
at once, before the next step: a front end sends one to read the current statistics
(`CoreClient.refresh_stats`, when /metrics is scraped).

With `stats_interval_s` the loop also writes the live statistics line (`stats_log`) every
that many seconds while there is work; an idle transport blocks no longer than `wake_in_s()`
so that the window in which work ended gets its line.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass

from rlt_contracts import (
    CoreAbort,
    CoreAdd,
    CoreClientGone,
    CoreOutputs,
    CorePDConnect,
    CoreReply,
    CoreShutdown,
    EngineDeadError,
    FinishReason,
    RequestOutputDelta,
    RltError,
    WireError,
)

from rlt.engine.core import EngineCore
from rlt.engine.stats_log import StatsLog, StatsSample, make_visible

STATS_INTERVAL_S = 0.05  # the longest a front end's statistics lag behind the core


@dataclass
class _PendingAdd:
    client: str
    message: CoreAdd
    compiled: concurrent.futures.Future


class CoreLoop:
    """Not thread-safe: the transport's one thread calls every method."""

    def __init__(
        self,
        core: EngineCore,
        *,
        constraint_compiler=None,
        pd_transport=None,
        stats_interval_s: float | None = None,
    ) -> None:
        """`stats_interval_s`: seconds between live statistics lines (None: none)."""
        self.core = core
        self._compiler = constraint_compiler
        self._pd_transport = pd_transport
        self._owners: dict[str, str] = {}  # request id -> the client that added it
        self._clients: set[str] = set()  # every front end that spoke: statistics go to all
        self._deltas: dict[str, list[RequestOutputDelta]] = {}
        self._replies: dict[str, list[CoreReply]] = {}
        self._pending: deque[_PendingAdd] = deque()
        self._aborted_while_pending: dict[str, FinishReason] = {}
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._changed = False  # something happened since the last take_outputs
        self._stats_sent_s = 0.0
        self._stats_log: StatsLog | None = None
        if stats_interval_s is not None:
            make_visible()
            self._stats_log = StatsLog(lambda: StatsSample.of(core), stats_interval_s)
        self.stopped = False

    # -- state ---------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """A step has something to do (otherwise the transport may block for messages)."""
        return self.core.has_unfinished_requests()

    @property
    def has_replies(self) -> bool:
        """Answers wait: send them before the next step (a step that fails must not swallow
        the answer to a request it already accepted)."""
        return bool(self._replies)

    @property
    def compiling(self) -> bool:
        """Adds wait for their grammars: poll again soon even when idle."""
        return bool(self._pending)

    def wake_in_s(self) -> float | None:
        """Seconds an idle transport may block before calling `step()` again although no
        message came: when the live statistics line of the window in which work ended is due
        (None: until a message comes)."""
        if self._stats_log is None:
            return None
        return self._stats_log.seconds_until_due(time.monotonic())

    # -- messages ------------------------------------------------------------------------------
    def handle(self, client: str, message) -> None:
        self._changed = True
        if not isinstance(message, CoreClientGone):
            self._clients.add(client)
        if isinstance(message, CoreAdd):
            self._add(client, message)
        elif isinstance(message, CoreAbort):
            self._abort(message.request_ids, message.finish_reason, client)
        elif isinstance(message, CorePDConnect):
            self._reply(client, message.call_id, *self._pd_connect(message.peers))
        elif isinstance(message, CoreClientGone):
            gone = [r for r, owner in self._owners.items() if owner == message.client]
            self._abort(gone, FinishReason.ABORT, message.client)
            self._deltas.pop(message.client, None)
            self._replies.pop(message.client, None)
            self._clients.discard(message.client)
        elif isinstance(message, CoreShutdown):
            self.shutdown()
        else:
            raise TypeError(f"not a core message: {type(message).__name__}")

    def _add(self, client: str, message: CoreAdd) -> None:
        if not message.requests:  # a statistics read: the reply carries them
            self._reply(client, message.call_id)
            return
        specs = {r.sampling.structured_output for r in message.requests} - {None}
        if specs and self._compiler is not None:
            if self._compile_pool is None:
                self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="rlt-grammars"
                )
            compiled = self._compile_pool.submit(self._compile_all, specs)
            self._pending.append(_PendingAdd(client, message, compiled))
        else:
            self._queue(client, message)

    def _compile_all(self, specs) -> None:
        for spec in specs:
            self._compiler.compile_grammar(spec)

    def poll_compiles(self) -> None:
        """Queue the adds whose grammars are compiled, in the order they arrived."""
        while self._pending and self._pending[0].compiled.done():
            pending = self._pending.popleft()
            self._changed = True
            error = pending.compiled.exception()
            if error is not None:
                self._drop_pending_aborts(pending.message)
                self._reply(pending.client, pending.message.call_id, WireError.of(error))
            else:
                self._queue(pending.client, pending.message)

    def _queue(self, client: str, message: CoreAdd) -> None:
        try:
            self.core.add_requests(message.requests)
        except RltError as error:
            self._drop_pending_aborts(message)
            self._reply(client, message.call_id, WireError.of(error))
            return
        for request in message.requests:
            self._owners[request.request_id] = client
        self._reply(client, message.call_id)
        late = [
            (r.request_id, self._aborted_while_pending.pop(r.request_id))
            for r in message.requests
            if r.request_id in self._aborted_while_pending
        ]
        for request_id, reason in late:
            self._abort((request_id,), reason, client)

    def _drop_pending_aborts(self, message: CoreAdd) -> None:
        for request in message.requests:
            self._aborted_while_pending.pop(request.request_id, None)

    def _abort(self, request_ids, reason: FinishReason, client: str) -> None:
        pending_ids = {
            r.request_id for p in self._pending if p.client == client for r in p.message.requests
        }
        for request_id in request_ids:
            if self._owners.get(request_id) != client:
                if request_id in pending_ids:
                    self._aborted_while_pending[request_id] = reason
                continue  # finished already, or another front end's request
            if reason is FinishReason.ABORT:
                self.core.abort_request(request_id)
            else:
                self.core.finish_request(request_id, reason)
        self._route(self.core.take_outputs())

    def _pd_connect(self, peers) -> tuple:
        if self._pd_transport is None:
            return (WireError("PDIncompatibleError", "this instance has PD role none"),)
        from rlt_pd import PDCompatibilityError

        connected, incompatible, failed = [], [], []
        for metadata in peers:
            try:
                connected.append(self._pd_transport.connect(metadata))
            except PDCompatibilityError as error:
                incompatible.append(str(error))
            except RltError as error:
                failed.append(str(error))
        return None, [connected, incompatible, failed]

    def _reply(self, client: str, call_id: int, error: WireError | None = None, result=None):
        self._replies.setdefault(client, []).append(CoreReply(call_id, error, result))

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step if any request is unfinished; grammars that finished compiling
        first."""
        if self._pending:
            self.poll_compiles()
        stats_log = self._stats_log
        if self.core.has_unfinished_requests():
            if stats_log is not None:
                stats_log.step_starting()
            deltas = self.core.step()
            now = time.monotonic()
            idle = not self.core.has_unfinished_requests()
            if stats_log is not None:
                stats_log.step_done(now, idle)
            if deltas or idle or now - self._stats_sent_s >= STATS_INTERVAL_S:
                # a step without results (a prompt chunk, a PD instance polling its transfers
                # thousands of times a second) sends its statistics at most every interval;
                # the step that left the core idle always does (the loop then blocks: a held
                # transfer released without a delta would stay in the front's load forever)
                self._changed = True
            self._route(deltas)
        elif stats_log is not None:
            stats_log.idle_tick(time.monotonic())

    def _route(self, deltas: list[RequestOutputDelta]) -> None:
        owners = self._owners
        for delta in deltas:
            client = owners.get(delta.request_id)
            if client is None:
                continue
            if delta.finished:
                del owners[delta.request_id]
            self._deltas.setdefault(client, []).append(delta)

    def take_outputs(self) -> dict[str, CoreOutputs]:
        """This round's outputs per front end (every one that spoke, when anything changed),
        each with the statistics after the round."""
        if not self._changed:
            return {}
        self._changed = False
        self._stats_sent_s = time.monotonic()
        stats = self.core.stats()
        deltas, self._deltas = self._deltas, {}
        replies, self._replies = self._replies, {}
        return {
            client: CoreOutputs(
                tuple(deltas.get(client, ())), tuple(replies.get(client, ())), stats
            )
            for client in self._clients | set(deltas) | set(replies)
        }

    def shutdown(self) -> None:
        """Abort every request (their final deltas go out with the next take_outputs)."""
        self._changed = True
        for pending in self._pending:
            pending.compiled.cancel()
            shutting_down = EngineDeadError("the engine is shutting down")
            self._reply(pending.client, pending.message.call_id, WireError.of(shutting_down))
        self._pending.clear()
        self._aborted_while_pending.clear()
        for request_id in list(self._owners):
            self.core.abort_request(request_id)
        self._route(self.core.take_outputs())
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self.stopped = True
