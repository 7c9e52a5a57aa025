"""`AsyncEngine`: a `CoreClient` whose engine core runs on a thread of this process (M1/M2).

The same messages and the same `CoreLoop` as the engine-core process (`core_process.py`),
moved by queues instead of ZeroMQ: the offline API, tests and embedders get the front end that
`rlt serve` runs, without a second process. `LLMEngine` is not thread-safe, so from the
constructor on only the engine thread touches its core:

    event loop                                   engine thread
    ----------                                   -------------
    CoreClient.send(message) --SimpleQueue-->    CoreLoop.handle (blocks while idle)
                                                 CoreLoop.step()
    CoreClient.on_outputs  <--call_soon_threadsafe--  CoreLoop.take_outputs()

The client follows the event loop of the latest call (a submit, a PD connect). Requests still
live on a loop that was closed (an `asyncio.run` that ended while they ran) are aborted when a
new loop calls: nobody can read them any more.

If the engine thread fails, every live stream ends with the error, later submits raise
`EngineDeadError`, and `dead` says why; nothing restarts the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from rlt_contracts import CoreAbort, CoreShutdown, EngineDeadError

from rlt.engine.core_loop import CoreLoop
from rlt.engine.llm_engine import LLMEngine
from rlt.serving.core_client import CoreClient

logger = logging.getLogger(__name__)

_CLIENT = "local"
COMPILE_POLL_S = 0.005  # how often an idle core looks at grammars being compiled


class _ThreadTransport:
    """Queues between the event loop and the engine thread."""

    def __init__(self, engine: LLMEngine, thread_name: str) -> None:
        parts = engine.parts
        config = engine.config
        self.core_loop = CoreLoop(
            engine.core,
            constraint_compiler=parts.constraint_compiler,
            pd_transport=parts.pd.transport if parts.pd is not None else None,
            stats_interval_s=config.stats_interval_s if config.log_stats else None,
        )
        self.client: AsyncEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `closing` with sends
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def send(self, message) -> None:
        with self._lock:
            if self.closing or not self.thread.is_alive():
                raise EngineDeadError("the engine is not running")
            self._inbox.put(message)

    def begin_close(self) -> None:
        with self._lock:
            if not self.closing:
                self.closing = True
                self._inbox.put(CoreShutdown())

    async def close(self) -> None:
        self.begin_close()
        await asyncio.to_thread(self.thread.join)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        core_loop = self.core_loop
        try:
            while not core_loop.stopped:
                block = not core_loop.has_work
                timeout = self._idle_timeout_s(core_loop) if block else None
                for message in self._take(block, timeout):
                    core_loop.handle(_CLIENT, message)
                    if core_loop.stopped:
                        break
                if core_loop.has_replies:
                    self._deliver(core_loop.take_outputs())
                if not core_loop.stopped:
                    core_loop.step()
                self._deliver(core_loop.take_outputs())
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine
            logger.exception("engine thread failed")
            with self._lock:
                self.closing = True
            self._post("on_dead", EngineDeadError(f"engine thread failed: {exc!r}"))
            return
        self._post("on_dead", EngineDeadError("the engine was shut down"))

    @staticmethod
    def _idle_timeout_s(core_loop: CoreLoop) -> float | None:
        """How long to block for a message while idle: grammars being compiled are polled,
        and the live statistics line of an ended burst is written when due."""
        timeout = COMPILE_POLL_S if core_loop.compiling else None
        wake_s = core_loop.wake_in_s()
        if wake_s is not None:
            timeout = wake_s if timeout is None else min(timeout, wake_s)
        return timeout

    def _take(self, block: bool, timeout: float | None) -> list:
        messages = []
        if block:
            try:
                messages.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _deliver(self, outputs: dict) -> None:
        if _CLIENT in outputs:
            self._post("on_outputs", outputs[_CLIENT])

    def _post(self, method: str, argument) -> None:
        loop, client = self.loop, self.client
        if loop is None or client is None:
            if method == "on_dead" and client is not None:
                client.mark_dead(argument)
            return
        try:
            loop.call_soon_threadsafe(getattr(client, method), argument)
        except RuntimeError:  # the consumer's loop is closed: nobody listens there any more
            if method == "on_dead":
                client.mark_dead(argument)


class AsyncEngine(CoreClient):
    """`rlt_contracts.EngineClient` over a local `LLMEngine` whose core runs on its own thread.

    The caller hands over the engine: from then on only the engine thread may use it.
    """

    def __init__(self, engine: LLMEngine, *, thread_name: str = "rlt-engine") -> None:
        self._engine = engine
        self._thread_transport = _ThreadTransport(engine, thread_name)
        super().__init__(
            self._thread_transport,
            model_info=engine.model_info(),
            stats=engine.get_stats(),
            tokenizer=engine.tokenizer_or_none,
        )
        self._thread_transport.client = self
        self._thread_transport.thread.start()

    @property
    def stopped(self) -> bool:
        """The engine thread has ended: the engine may be used (or shut down) directly again."""
        return not self._thread_transport.thread.is_alive()

    def mark_dead(self, error: BaseException) -> None:
        """Record the death without a loop to run `on_dead` on (no stream can be waiting)."""
        if self._dead is None:
            self._dead = error

    async def _call(self, make_message):
        self._follow_loop(asyncio.get_running_loop())
        return await super()._call(make_message)

    def _follow_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        transport = self._thread_transport
        previous = transport.loop
        if previous is loop:
            return
        if previous is not None:
            orphans = tuple(r for r, s in self._streams.items() if not s.state.ended)
            if orphans:
                self._transport_send_quietly(CoreAbort(orphans))
            self._processor.drop([s.state for s in self._streams.values()])
            self._streams.clear()
            self._unclaimed.clear()
        transport.loop = loop

    def close(self, timeout: float | None = None) -> None:
        """Synchronous `shutdown()` for callers without an event loop (idempotent)."""
        self._stopping = True
        self._thread_transport.begin_close()
        self._thread_transport.thread.join(timeout)
