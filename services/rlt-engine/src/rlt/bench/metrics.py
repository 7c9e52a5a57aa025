"""Aggregate per-request measurements into the result of a run (vLLM's key names).

Latency statistics cover the completed requests only, in milliseconds: for each of `ttft`,
`tpot`, `itl`, `e2el` the keys `mean_X_ms`, `median_X_ms`, `std_X_ms`, `min_X_ms`, `max_X_ms`,
and `pQ_X_ms` for every requested percentile Q (vLLM's `--metric-percentiles`; linear
interpolation between order statistics, numpy's default) of the metrics X that
`--percentile-metrics` selects (default: all four). ITL pools the chunk gaps of every
request; TPOT leaves out one-token requests. Goodput (vLLM's `--goodput`): a completed
request is good when each given SLO holds (`ttft`, `tpot`, `e2el`, in ms; a one-token request
passes the TPOT one); `request_goodput` is None without SLOs, as in vLLM.

Peaks (vLLM's `max_output_tokens_per_s`, `max_concurrent_requests`): the run is cut into
one-second buckets from its start; each completed request's tokens fall into the bucket of the
chunk that carried them (its send time + TTFT + the chunk gaps), and it counts as in flight in
every bucket from the one it was sent in to the one it ended in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from rlt_contracts import ConfigurationError

from rlt.bench.request import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty sequence, interpolating linearly."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_key(q: float) -> str:
    return f"p{q:g}"


def describe(values_s: Sequence[float], name: str, percentiles: Iterable[float]) -> dict:
    """mean/median/std/min/max/pQ of `values_s` (seconds) in ms; None where there is none."""
    stats: dict[str, float | None] = {}
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms) if ms else None
    stats[f"mean_{name}_ms"] = mean
    stats[f"median_{name}_ms"] = percentile(ms, 50) if ms else None
    stats[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else None
    stats[f"min_{name}_ms"] = min(ms) if ms else None
    stats[f"max_{name}_ms"] = max(ms) if ms else None
    for q in percentiles:
        stats[f"{percentile_key(q)}_{name}_ms"] = percentile(ms, q) if ms else None
    return stats


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigurationError("metric_percentiles", f"not numbers: {text!r}") from None
    if not values or not all(0 < q < 100 for q in values):
        raise ConfigurationError("metric_percentiles", f"each must be in (0, 100): {text!r}")
    return values


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """Parse vLLM's --percentile-metrics: "ttft,tpot" -> ("ttft", "tpot")."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if not names or unknown:
        raise ConfigurationError(
            "percentile_metrics",
            f"comma-separated names out of {','.join(LATENCY_METRICS)}, got {text!r}",
        )
    return tuple(dict.fromkeys(names))


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ConfigurationError(
                "goodput", f"expected KEY:MS with KEY one of {GOODPUT_METRICS}, got {item!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ConfigurationError("goodput", f"not a number of ms: {item!r}") from None
        if not slos[name] >= 0:
            raise ConfigurationError("goodput", f"must be >= 0 ms: {item!r}")
    return slos


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    if not result.success:
        return False
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    for name, limit_ms in slos.items():
        value = measured[name]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def _rate(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def peaks(done: Sequence[RequestResult]) -> tuple[float, int]:
    """(most output tokens in one second of the run, most requests in flight in one second)
    over the completed requests (see the module docstring)."""
    if not done:
        return 0.0, 0
    buckets = int(max(r.start + r.latency for r in done)) + 1
    tokens, in_flight = [0] * buckets, [0] * buckets
    for r in done:
        arrival = r.start + r.ttft
        for gap, count in zip([0.0, *r.itls], r.chunk_tokens, strict=False):
            arrival += gap
            tokens[min(int(arrival), buckets - 1)] += count
        for second in range(int(r.start), int(r.start + r.latency) + 1):
            in_flight[second] += 1
    return float(max(tokens)), max(in_flight)


def summarize(
    results: Sequence[RequestResult | None],
    duration: float,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    goodput_slos: dict[str, float] | None = None,
    percentile_metrics: Iterable[str] = LATENCY_METRICS,
) -> dict:
    """The aggregate and per-request result of one run. `results[i]` is None for a request
    that was never sent (the run was interrupted first)."""
    percentiles = tuple(percentiles)
    percentile_metrics = tuple(percentile_metrics)
    sent = [r for r in results if r is not None]
    done = [r for r in sent if r.success]
    errors = Counter(r.error_kind for r in sent if not r.success)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict = {
        "completed": len(done),
        "failed": len(sent) - len(done),
        "not_sent": len(results) - len(sent),
        "errors_by_kind": dict(sorted(errors.items())),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _rate(len(done), duration),
        "output_throughput": _rate(output_tokens, duration),
        "total_token_throughput": _rate(input_tokens + output_tokens, duration),
    }
    if goodput_slos:
        good = sum(is_good(r, goodput_slos) for r in done)
        summary.update(
            request_goodput=_rate(good, duration),
            good_requests=good,
            goodput_slos_ms=dict(goodput_slos),
        )
    else:
        summary["request_goodput"] = None
    summary["max_output_tokens_per_s"], summary["max_concurrent_requests"] = peaks(done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.latency for r in done],
    }
    for name in LATENCY_METRICS:
        chosen = percentiles if name in percentile_metrics else ()
        summary.update(describe(series[name], name, chosen))
    decoded = [d for r in done for d in r.exit_depths[1:]]
    chunks = sum(len(r.chunk_tokens) for r in done)
    summary.update(
        mean_loops_per_token=sum(decoded) / len(decoded) if decoded else None,
        mean_tokens_per_chunk=_rate(sum(r.tokens_seen for r in done), chunks) or None,
        token_count_mismatches=sum(
            r.usage_reported and r.exact_token_count and r.tokens_seen != r.output_tokens
            for r in done
        ),
    )
    summary.update(per_request(results))
    return summary


def per_request(results: Sequence[RequestResult | None]) -> dict[str, list]:
    """Parallel lists, one entry per request in dataset order (vLLM's `input_lens`,
    `output_lens`, `ttfts`, `itls`, `errors`, with times in seconds), None where unknown."""
    rows = [r or RequestResult(index=i, error_kind="not_sent") for i, r in enumerate(results)]
    sent = [r is not None for r in results]
    return {
        "input_lens": [r.prompt_tokens for r in rows],
        "output_lens": [r.output_tokens if r.success else None for r in rows],
        "ttfts": [r.ttft for r in rows],
        "itls": [r.itls for r in rows],
        "tpots": [r.tpot for r in rows],
        "e2els": [r.latency if r.success else None for r in rows],
        "start_times": [r.start if s else None for r, s in zip(rows, sent, strict=True)],
        "chunk_tokens": [r.chunk_tokens for r in rows],
        "loops_per_token": [r.loops_per_token for r in rows],
        "finish_reasons": [r.finish_reason for r in rows],
        "generated_texts": [r.generated_text for r in rows],
        "errors": [r.error for r in rows],
        "error_kinds": [None if r.success else r.error_kind for r in rows],
    }
