"""What the rlt-ray cluster tests share: a streamed completion read on its own thread (the
events so far with their arrival times, so that a stream that is slow or stalled after a kill
says how far it got), and the replicas' placement and health options on the test cluster."""

from __future__ import annotations

import json
import threading
import time

import httpx

# RayOptions of a replicas app on the test cluster: replicas on the "rlt_replica" nodes (no CPU
# reserved: 2 cores), the ingress on the head, health and routing statistics polled briskly
CLUSTER_REPLICA_OPTIONS = dict(
    num_cpus=0,
    resources={"rlt_replica": 1},
    ingress_resources={"rlt_head": 1},
    health_check_period_s=2,
    health_check_timeout_s=30,
    routing_stats_period_s=0.5,
)


class Stream:
    """POST a streaming completion to `url` on a thread; `started` is set at the first event
    (or when the stream ended without one)."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        self.events: list[object] = []
        self.arrivals: list[float] = []
        self.status: int | None = None
        self.started = threading.Event()
        body = {
            "model": "default_model",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    self.events.append("[DONE]" if data == "[DONE]" else json.loads(data))
                    self.arrivals.append(time.monotonic())
                    self.started.set()
        finally:
            self.started.set()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 120, what: str = "stream") -> list[object]:
        self.thread.join(timeout)
        assert not self.running, f"{what} did not end within {timeout:g} s: {self.progress()}"
        return self.events

    def progress(self) -> str:
        if not self.arrivals:
            return "no event yet"
        span = self.arrivals[-1] - self.arrivals[0]
        last = time.monotonic() - self.arrivals[-1]
        return f"{len(self.events)} events in {span:.1f} s, the last {last:.1f} s ago"
