"""Prometheus metrics of one server (GET /metrics, text exposition format): docs/serving.md,
"Metrics", lists them, what each observes and where the several front ends of one engine
keep theirs (`PROMETHEUS_MULTIPROC_DIR`).

Each app owns its registry. Engine gauges and counters are read from one
`EngineClient.stats()` snapshot at scrape time; per-request histograms are observed by the
HTTP layer as deltas reach it (client-side latencies on the front end's clock, engine phases
from the final delta's `RequestTimings`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import values as metric_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from rlt_contracts import EngineClient, FinishReason, RequestOutputDelta, RltError

PREFIX = "rlt:"
# vLLM's buckets; ITL and the request phases get a finer low end (a looped model's decode tick
# and an idle server's queue are often well under vLLM's first bucket).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
    10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own
STATS_REFRESH_TIMEOUT_S = 2.0  # a scrape waits this long for fresh engine statistics


@runtime_checkable
class StatsRefresh(Protocol):
    """Optional `EngineClient` capability: `refresh_stats()` reads the engine's current
    statistics (`stats()` returns them afterwards). A scrape calls it first; a client whose
    `stats()` is always current needs none."""

    async def refresh_stats(self) -> None: ...


def mark_front_end_gone(pid: int, directory: str) -> None:
    """A front end of a multi-process server exited: its live gauges leave `directory` (its
    counters and histograms stay: the totals never go back)."""
    mark_process_dead(pid, directory)


def _file_backed_values() -> None:
    """Make new metrics of this process keep their values in the multi-process directory.
    prometheus-client chooses when it is first imported; a front end forked from a process
    that imported it before the directory was set would keep them in memory, unseen by the
    other front ends' scrapes."""
    if metric_values.ValueClass is metric_values.MutexValue:
        metric_values.ValueClass = metric_values.get_value_class()


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets, base = [], 1
    while base <= max_model_len:
        buckets += [float(base * m) for m in (1, 2, 5) if base * m <= max_model_len]
        base *= 10
    return tuple(buckets)


def outcome_of_status(status: int) -> str:
    """The `outcome` label of a request answered with an error status."""
    return {401: "unauthorized", 429: "overloaded", 503: "unavailable"}.get(
        status, "invalid" if status < 500 else "error"
    )


class _EngineCollector(Collector):
    """Engine gauges and counters from one stats snapshot per scrape."""

    def __init__(self, client: EngineClient, is_alive: Callable[[], bool], model_name: str) -> None:
        self._client = client
        self._is_alive = is_alive
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._client.stats()
        total = stats.kv_blocks_total
        gauges = {
            "num_requests_running": (
                "Requests admitted (holding KV blocks): prefilling or decoding.",
                stats.running_requests,
            ),
            "num_requests_waiting": (
                "Requests waiting for admission (new or preempted).",
                stats.waiting_requests,
            ),
            "kv_cache_usage_perc": (
                "KV-cache usage: fraction of the KV blocks in use (1 means 100 percent).",
                stats.kv_blocks_used / total if total else 0.0,
            ),
            "kv_cache_blocks_used": ("KV cache blocks in use.", stats.kv_blocks_used),
            "kv_cache_blocks_free": ("KV cache blocks free.", stats.kv_blocks_free),
            "kv_cache_blocks_total": ("KV cache blocks in the pool.", total),
            "engine_up": (
                "1 while the engine runs, 0 once it died or shut down.",
                int(self._is_alive()),
            ),
        }
        labels = [self._model_name]
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        counters = {
            "prompt_tokens": (
                "Prompt tokens prefilled (prefix-cache hits excluded).",
                stats.prompt_tokens,
            ),
            "generation_tokens": ("Tokens generated.", stats.generation_tokens),
            "num_preemptions": ("Requests preempted (suspended).", stats.preemptions),
            "num_resumptions": ("Preempted requests resumed.", stats.resumptions),
            "prefix_cache_queries": (
                "Prefix cache queries, in prompt tokens looked up.",
                stats.prefix_cache_queried_tokens,
            ),
            "prefix_cache_hits": (
                "Prefix cache hits, in prompt tokens found.",
                stats.prefix_cache_hit_tokens,
            ),
            "engine_steps": ("Engine steps applied.", stats.steps),
            "decode_loops": (
                "Recurrent loops run for decoded tokens (token 0, from prefill, excluded).",
                stats.decode_loops,
            ),
            "spec_decode_num_drafts": (
                "Speculative rounds (per request) that drafted tokens.",
                stats.spec_drafts,
            ),
            "spec_decode_num_draft_tokens": (
                "Draft tokens proposed by speculative decoding.",
                stats.spec_draft_tokens,
            ),
            "spec_decode_num_accepted_tokens": (
                "Draft tokens the verify pass accepted.",
                stats.spec_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the round (0 = the first draft).",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([self._model_name, str(position)], accepted)
        yield per_position


class ServingMetrics:
    """The registry of one app and the observations of its HTTP layer.

    model_name: the `model_name` label (the served model name); defaults to the engine's model
    name, which is what `rlt serve` serves unless --served-model-name renames it.
    """

    def __init__(
        self,
        client: EngineClient,
        *,
        model_depth: int,
        is_alive: Callable[[], bool],
        model_name: str | None = None,
    ) -> None:
        info = client.model_info()
        self.model_name = model_name if model_name is not None else info.name
        self._client = client
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self._engine_collector = _EngineCollector(client, is_alive, self.model_name)
        # a multi-process server's metrics directory, or None (one process)
        self._multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_VARIABLE) or None
        if self._multiprocess_dir is not None:
            _file_backed_values()

        def histogram(name: str, doc: str, buckets: Sequence[float]):
            return Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry
            ).labels(self.model_name)

        self._requests = Counter(
            PREFIX + "http_requests",
            "Generation requests (HTTP) by endpoint and outcome.",
            ["model_name", "endpoint", "outcome"],
            registry=registry,
        )
        request_success = Counter(
            PREFIX + "request_success",
            "Engine requests finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._request_success = {
            str(reason): request_success.labels(self.model_name, str(reason))
            for reason in FinishReason
        }
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time to first token: request submitted -> its first token at the server.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Inter-token latency: gap between consecutive tokens of a request at the server "
            "(one observation per token after the first; a delta's tokens share its gap).",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency: request submitted -> its final delta at the server.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited for admission (engine clock).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Admission -> first token read back (engine clock).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "First token -> last token read back (engine clock).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Admission -> last token read back: prefill plus decode (engine clock).",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = token_count_buckets(info.max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", token_buckets
        )
        self.generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request.",
            token_buckets,
        )
        self.loops_per_token = histogram(
            "loops_per_token",
            "Exit depth (loops run) of each decoded token, token 0 (prefill) excluded; "
            "bucket le=k minus bucket le=k-1 counts the tokens that exited at depth k.",
            tuple(float(d) for d in range(1, model_depth + 1)),
        )
        registry.register(self._engine_collector)

    def count(self, path: str, outcome: str) -> None:
        """One HTTP generation request answered with `outcome`."""
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            self._requests.labels(self.model_name, endpoint, outcome).inc()

    def observe_tokens(
        self,
        exit_depths: Sequence[int],
        *,
        tokens_before: int,
        last_token_time: float | None,
        start: float,
        now: float,
    ) -> None:
        """A delta brought `len(exit_depths)` (> 0) tokens of one request at `now`.

        tokens_before: tokens of the request received earlier; last_token_time: when the latest
        of them arrived (None before the first token); start: when the request was submitted.
        Tokens that arrive together with the first one have an inter-token latency of 0.
        """
        count = len(exit_depths)
        if last_token_time is None:
            self.time_to_first_token.observe(now - start)
            gap, count = 0.0, count - 1
        else:
            gap = (now - last_token_time) / count
        itl = self.inter_token_latency
        for _ in range(count):
            itl.observe(gap)
        loops = self.loops_per_token
        for depth in exit_depths if tokens_before else exit_depths[1:]:
            loops.observe(depth)

    def observe_finished(
        self, delta: RequestOutputDelta, *, prompt_tokens: int, generated_tokens: int, e2e: float
    ) -> None:
        """The final delta of one engine request reached the server `e2e` seconds after it was
        submitted."""
        self._request_success[str(delta.finish_reason or FinishReason.ABORT)].inc()
        self.e2e_request_latency.observe(e2e)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated_tokens)
        timings = delta.timings
        if timings is None:
            return
        for histogram, value in (
            (self.queue_time, timings.queue_time),
            (self.prefill_time, timings.prefill_time),
            (self.decode_time, timings.decode_time),
            (self.inference_time, timings.inference_time),
        ):
            if value is not None:
                histogram.observe(value)

    async def scrape(self) -> bytes:
        """The exposition of a GET /metrics. With several front ends the engine's statistics
        are refreshed first (if the client can; a dead, stopping or busy engine leaves the last
        ones): this front end may not have heard from the core for a while."""
        if self._multiprocess_dir is not None and isinstance(self._client, StatsRefresh):
            try:
                await asyncio.wait_for(self._client.refresh_stats(), STATS_REFRESH_TIMEOUT_S)
            except (RltError, TimeoutError):
                pass
        return self.render()

    def render(self) -> bytes:
        """This process's metrics; with several front ends, the HTTP layer's of all of them
        (summed from the multi-process directory) and the engine's."""
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiprocess_dir)
        registry.register(self._engine_collector)
        return generate_latest(registry)
