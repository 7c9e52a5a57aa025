"""Prometheus metrics of one server (GET /metrics, text exposition format).

Each app owns its registry (several apps in one process never share counters). Engine
counters and gauges are read from `EngineClient.stats()` at scrape time; latency and loop
histograms are observed by the HTTP layer as deltas reach it.

  rlt_requests_total{endpoint,outcome}      counter: one per generation request; outcome is
                                            stop | length | abort | invalid | unauthorized |
                                            overloaded | unavailable | error
  rlt_requests_running / rlt_requests_waiting                  gauges (engine)
  rlt_kv_blocks_used / _free / _total                          gauges (engine)
  rlt_prompt_tokens_total / rlt_generation_tokens_total        counters (engine)
  rlt_engine_steps_total, rlt_decode_loops_total, rlt_preemptions_total, rlt_resumptions_total,
  rlt_prefix_cache_hit_tokens_total, rlt_prefix_cache_queried_tokens_total  counters (engine)
  rlt_engine_up                                                gauge: 1 running, 0 dead
  rlt_time_to_first_token_seconds          histogram: arrival -> first token at the frontend
  rlt_inter_token_latency_seconds          histogram: gap between tokens (per token)
  rlt_request_latency_seconds              histogram: arrival -> last delta
  rlt_loops_per_token                      histogram: exit depth of each decoded token
                                           (token 0 comes from prefill and is excluded)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rlt_contracts import EngineClient

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def outcome_of_status(status: int) -> str:
    """The `outcome` label of a request answered with an error status."""
    return {401: "unauthorized", 429: "overloaded", 503: "unavailable"}.get(
        status, "invalid" if status < 500 else "error"
    )


class _EngineCollector(Collector):
    def __init__(self, client: EngineClient, is_alive: Callable[[], bool]) -> None:
        self._client = client
        self._is_alive = is_alive

    def collect(self) -> Iterable[Metric]:
        stats = self._client.stats()
        gauges = {
            "rlt_requests_running": (
                "Requests holding KV blocks and decoding.",
                stats.running_requests,
            ),
            "rlt_requests_waiting": ("Requests queued for admission.", stats.waiting_requests),
            "rlt_kv_blocks_used": ("KV cache blocks in use.", stats.kv_blocks_used),
            "rlt_kv_blocks_free": ("KV cache blocks free.", stats.kv_blocks_free),
            "rlt_kv_blocks_total": ("KV cache blocks in the pool.", stats.kv_blocks_total),
            "rlt_engine_up": (
                "1 while the engine runs, 0 once it died or shut down.",
                int(self._is_alive()),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "rlt_prompt_tokens": ("Prompt tokens prefilled.", stats.prompt_tokens),
            "rlt_generation_tokens": ("Tokens generated.", stats.generation_tokens),
            "rlt_engine_steps": ("Engine steps run.", stats.steps),
            "rlt_decode_loops": ("Recurrent loops run for decoded tokens.", stats.decode_loops),
            "rlt_preemptions": ("Requests preempted.", stats.preemptions),
            "rlt_resumptions": ("Preempted requests resumed.", stats.resumptions),
            "rlt_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache.",
                stats.prefix_cache_hit_tokens,
            ),
            "rlt_prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queried_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class ServingMetrics:
    def __init__(
        self, client: EngineClient, *, model_depth: int, is_alive: Callable[[], bool]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "rlt_requests",
            "Generation requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "rlt_time_to_first_token_seconds",
            "Arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "rlt_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "rlt_request_latency_seconds",
            "Arrival to the end of the request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.loops_per_token = Histogram(
            "rlt_loops_per_token",
            "Exit depth (loops) of each decoded token.",
            buckets=tuple(float(d) for d in range(1, model_depth + 1)),
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(client, is_alive))

    def count(self, path: str, outcome: str) -> None:
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def observe_loops(self, exit_depths: Sequence[int]) -> None:
        for depth in exit_depths:
            self.loops_per_token.observe(depth)

    def render(self) -> bytes:
        return generate_latest(self.registry)
