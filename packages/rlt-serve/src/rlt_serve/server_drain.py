"""`ServerDrain`: the serving phase of the stop-signal policy (`rlt_serve.shutdown`) for an
HTTP server with uvicorn's flags, shared by `rlt serve`'s front ends and `rlt pd serve`.

    stage 1  `server.should_exit`: uvicorn stops accepting connections, closes idle ones and
             waits for the requests in flight; `grace_s` later (`grace_period`) `abort()` ends
             the ones still running through the engine client, so each still answers (200 with
             its partial text and finish_reason "abort", a stream's last chunk and `[DONE]`)
    stage 2  `abort()` at once: the same answers, without waiting
    stage 3  `server.force_exit`: uvicorn stops waiting for connections

uvicorn is duck-typed here (rlt-serve does not depend on it): the server has `should_exit`,
`force_exit` and `lifespan`. A server subclass routes its `capture_signals()` to `act` (so
uvicorn installs no handler of its own and raises no captured signal again on exit) and wraps
its `shutdown()` in `grace_period()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from rlt_serve.shutdown import StopSignals, signal_name

logger = logging.getLogger("rlt_serve.shutdown")

LIFESPAN_STOP_S = 10.0  # after a forced exit: how long the app's own shutdown may take


class ServerDrain:
    def __init__(
        self,
        server,
        signals: StopSignals,
        *,
        grace_s: float,
        abort: Callable[[], Awaitable[None]],
    ) -> None:
        self._server = server
        self.signals = signals
        self.grace_s = grace_s
        self._abort = abort
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_task: asyncio.Task | None = None
        self._abort_requested = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """While the server runs (its event loop in this thread), counted signals drain it."""
        self._loop = asyncio.get_running_loop()
        with self.signals.acting(self.act):
            yield

    def act(self, signum: int, stage: int) -> None:
        name = signal_name(signum)
        if stage == 1:
            logger.info(
                "%s: stopping; requests in flight get up to %g s to finish (a second SIGINT or "
                "SIGTERM ends them at once)",
                name,
                self.grace_s,
            )
            self._server.should_exit = True
        elif stage == 2:
            logger.warning("%s during the drain: ending the requests still running", name)
            self._abort_requested = True  # (before the loop runs: at the start of the drain)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.abort_now)
        else:
            logger.warning("%s: stopping at once", name)
            self._server.force_exit = True

    def abort_now(self) -> None:
        """End what still runs (once); on the server's loop."""
        if self._abort_task is None:
            self._abort_task = asyncio.get_running_loop().create_task(self._abort())

    @contextlib.asynccontextmanager
    async def grace_period(self) -> AsyncIterator[None]:
        """Around uvicorn's shutdown: `grace_s` into it, abort what still runs; after a forced
        exit (which skips the app's lifespan shutdown, whose task asyncio would then cancel
        with a traceback), run that shutdown."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        timer = loop.call_later(0 if self._abort_requested else self.grace_s, self.abort_now)
        try:
            yield
        finally:
            timer.cancel()
        if self._abort_task is not None:
            with contextlib.suppress(Exception):
                await self._abort_task
        if self._server.force_exit:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.lifespan.shutdown(), LIFESPAN_STOP_S)
