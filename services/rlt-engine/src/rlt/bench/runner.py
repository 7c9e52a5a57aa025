"""Send a workload on its arrival schedule and collect one `RequestResult` per request.

Each request waits for its arrival time, then for a free slot when `max_concurrency` is set
(its TTFT and latency are counted from when it is actually sent), then streams. Ctrl-C
(SIGINT) stops the run cleanly: requests not yet sent are left out (`None`), those in flight
are cancelled and recorded as failed with kind `cancelled`, and the partial run is returned
with `interrupted` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rlt.bench.datasets import BenchRequest
from rlt.bench.request import Endpoint, RequestOptions, RequestResult, send_request


@dataclass
class RunOutcome:
    results: list[RequestResult | None]
    duration: float  # seconds from the first arrival slot to the last request's end
    interrupted: bool = False
    started_s: float = 0.0  # the run's start on time.perf_counter (the machine's monotonic clock)


def make_client(endpoint: Endpoint, *, api_key: str, timeout: float, trust_env: bool):
    """The benchmark's client (`wire_client.WireClient`: OpenAI's wire format, no retries, so
    no retried request skews latencies)."""
    from rlt.bench.wire_client import WireClient

    return WireClient(endpoint.api_base, api_key=api_key, timeout=timeout, trust_env=trust_env)


@contextlib.contextmanager
def _sigint_cancels(tasks_holder: list, state: dict):
    """While the run lasts, SIGINT cancels the request tasks instead of raising
    KeyboardInterrupt; a second SIGINT falls back to the default (immediate) behaviour."""
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        state["interrupted"] = True
        for task in tasks_holder:
            task.cancel()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def run_requests(
    client,
    endpoint: Endpoint,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    options: RequestOptions,
    *,
    max_concurrency: int | None = None,
    progress=None,
) -> RunOutcome:
    """Send every request at its arrival time (seconds after the start)."""
    if len(arrivals) != len(requests):
        raise ValueError("one arrival time per request")
    results: list[RequestResult | None] = [None] * len(requests)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(i: int, request: BenchRequest) -> None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots if slots is not None else contextlib.nullcontext():
            results[i] = RequestResult(index=i)
            await send_request(client, endpoint, request, options, results[i], start)
        if progress is not None:
            progress.update(1)

    state = {"interrupted": False}
    tasks: list[asyncio.Task] = []
    with _sigint_cancels(tasks, state):
        tasks.extend(asyncio.create_task(one(i, r)) for i, r in enumerate(requests))
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - start
    for result in results:  # a request cancelled before send_request started
        if result is not None and result.error_kind is None and not result.success:
            result.error_kind, result.error = "cancelled", "the benchmark was interrupted"
    return RunOutcome(results, duration, state["interrupted"], start)
