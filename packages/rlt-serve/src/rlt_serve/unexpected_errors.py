"""Answer an unexpected exception with a JSON 500 and keep the connection usable.

Starlette's last-resort handler (the one registered for `Exception`) answers and then raises
the exception again for the server to log, and uvicorn closes the keep-alive connection after
it. This middleware sits inside that handler, right outside the routes' own error handlers: it
logs the traceback once, answers `{"error": {...}}` with status 500 (counted in the metrics),
and returns normally, so the client's next request on the same connection is served. An
exception after the response started (a stream) cannot be answered any more and is re-raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlt_serve.errors import from_engine_error

logger = logging.getLogger("rlt_serve")


class UnexpectedErrorsAnswered:
    def __init__(
        self, app: ASGIApp, *, on_error: Callable[[str], None] = lambda path: None
    ) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            self.on_error(scope["path"])
            await from_engine_error(exc).response()(scope, receive, send)
