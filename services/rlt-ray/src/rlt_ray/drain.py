"""Draining an ingress when `rlt ray serve` / `rlt ray pd serve` stop: what `rlt serve` does
on SIGINT / SIGTERM, across Ray.

    driver (the command)                      every ingress replica
    DrainSignal.request(grace_s) --GCS KV-->  watch(): Drainer.request(grace_s)
    serve.delete(app)                           new HTTP requests: 503 engine_unavailable
      (Serve waits for each replica's           in flight: `grace_s` to finish, then
       requests in flight)                      abort() ends the rest with finish_reason
                                                "abort" (streams: last chunk + [DONE])

The signal is one key in Ray's GCS key-value store, unique to one run of the command: each
ingress replica polls it (every `POLL_S`), so every replica drains, however many there are. A
second request with grace 0 (a second Ctrl-C) aborts what still runs at once. An ingress
deployed without a key (`serve deploy` of `app_builder`) is never asked: Serve's own graceful
shutdown applies (requests still running at its timeout are cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

KV_NAMESPACE = "rlt_ray"
POLL_S = 0.25
FLUSH_S = 5.0  # after the abort: time for the aborted responses to go out
SHUTTING_DOWN = "the server is shutting down"


def new_drain_key(app_name: str) -> str:
    return f"drain/{app_name}/{uuid.uuid4().hex}"


class DrainSignal:
    """The driver's side: `request(grace_s)` asks every ingress replica of this run to drain
    (again with a smaller grace: abort sooner); `clear()` removes the key."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._sequence = 0

    def request(self, grace_s: float) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        self._sequence += 1
        value = json.dumps({"grace_s": grace_s, "sequence": self._sequence})
        _internal_kv_put(self.key, value, overwrite=True, namespace=KV_NAMESPACE)

    def clear(self) -> None:
        """Remove the key and the replicas' reports."""
        from ray.experimental.internal_kv import _internal_kv_del

        with contextlib.suppress(Exception):  # the cluster may be gone already
            _internal_kv_del(self.key, del_by_prefix=True, namespace=KV_NAMESPACE)


def drained_replicas(key: str) -> int:
    """How many ingress replicas reported their drain done (for the run of `key`)."""
    from ray.experimental.internal_kv import _internal_kv_list

    try:
        return len(_internal_kv_list(f"{key}/done/", namespace=KV_NAMESPACE))
    except Exception:  # noqa: BLE001 - the GCS may be busy: asked again
        return 0


async def watch(key: str, drainer: Callable[[], Drainer | None]) -> None:
    """The ingress's side: poll `key`, hand each new request to `drainer()` (None until the
    ingress built its app: the request is handed over once it did), and report once its drain
    is done (runs until cancelled; a failed poll is retried)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    seen = 0
    reported = False
    while True:
        try:
            current = drainer()
            raw = await asyncio.to_thread(_internal_kv_get, key, namespace=KV_NAMESPACE)
            if raw and current is not None:
                message = json.loads(raw)
                if message["sequence"] > seen:
                    seen = message["sequence"]
                    current.request(float(message["grace_s"]))
            if current is not None and current.done.is_set() and not reported:
                done_key = f"{key}/done/{uuid.uuid4().hex}"
                await asyncio.to_thread(_internal_kv_put, done_key, "1", namespace=KV_NAMESPACE)
                reported = True
        except Exception as exc:  # noqa: BLE001 - the GCS may be busy: next poll
            logger.debug("drain signal poll failed: %s", exc)
        await asyncio.sleep(POLL_S)


class Drainer:
    """Wraps an ingress's ASGI app: counts its HTTP requests in flight and, once asked to
    drain, answers new ones 503 (`engine_unavailable`, "the server is shutting down"), waits
    up to the grace for those in flight, then awaits `abort()` (the engine client ends what
    still runs with finish_reason "abort") and gives the aborted answers `FLUSH_S` to go out.
    """

    def __init__(self, app, abort: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self._abort = abort
        self.in_flight = 0
        self.draining = False
        self._deadline = math.inf
        self._changed = asyncio.Event()
        self.done = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: the app's own
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _shutting_down_response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self._changed.set()

    def request(self, grace_s: float) -> None:
        """Drain with `grace_s` left for the requests in flight (a smaller grace than an earlier
        request's shortens it; 0 aborts at once)."""
        self._deadline = min(self._deadline, time.monotonic() + max(grace_s, 0.0))
        if not self.draining:
            self.draining = True
            logger.info(
                "draining: %d requests in flight, %.1f s to finish", self.in_flight, grace_s
            )
            self._task = asyncio.get_running_loop().create_task(self._drain())
        self._changed.set()

    async def _drain(self) -> None:
        try:
            await self._until_idle(lambda: self._deadline)
            if self.in_flight:
                logger.info("draining: aborting %d requests still in flight", self.in_flight)
            await self._abort()  # also refuses what reaches the engine client from now on
            flushed = time.monotonic() + FLUSH_S
            await self._until_idle(lambda: flushed)
            logger.info("drained (%d requests still open)", self.in_flight)
        finally:
            self.done.set()

    async def _until_idle(self, deadline: Callable[[], float]) -> None:
        """Until no request is in flight or `deadline()` (re-read: a request may move it)."""
        while self.in_flight and (left := deadline() - time.monotonic()) > 0:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


def _shutting_down_response():
    from rlt_serve.errors import APIError

    return APIError(
        503,
        f"the engine is unavailable: {SHUTTING_DOWN}",  # as rlt-serve words EngineDeadError
        type="service_unavailable",
        code="engine_unavailable",
    ).response()


WAIT_LOOP_S = 0.25  # Serve's poll of a stopping replica's requests (its default: 2 s)


def serve_shutdown_options(grace_s: float, *, ingress: bool) -> dict:
    """Serve's graceful-shutdown options for a deployment of an app that drains with `grace_s`:
    Serve's timeout is only the bound after which it kills a stopping replica, so it must not
    cut the drain (the ingress's, then the aborted answers' `FLUSH_S`); the engine replicas'
    requests end before the ingress's."""
    margin = FLUSH_S + (10.0 if ingress else 5.0)
    return {
        "graceful_shutdown_timeout_s": grace_s + margin,
        "graceful_shutdown_wait_loop_s": WAIT_LOOP_S,
    }
