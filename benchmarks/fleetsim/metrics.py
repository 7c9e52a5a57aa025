"""Latency percentiles, prefix hit rate and the SLO over a measurement window.

A request is measured when it arrived inside [warmup, horizon]. TTFT = first token - arrival;
TPOT = (finish - first token) / (output tokens - 1), as `rlt bench serve` computes them. A
request that did not finish counts with infinite TTFT and TPOT. The SLO holds for a run when
TTFT p99 <= 1 s and TPOT p99 <= 50 ms over its measured requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .traces import Request


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float = 1.0
    tpot_p99_s: float = 0.050


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of sorted `values`."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    if ordered[high] == math.inf:
        return math.inf if position > low or ordered[low] == math.inf else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(
    requests: list[Request], *, warmup_s: float, horizon_s: float, slo: SLO = SLO()
) -> dict:
    measured = [r for r in requests if warmup_s <= r.arrival_s <= horizon_s]
    window = horizon_s - warmup_s
    ttfts = [r.first_token_s - r.arrival_s for r in measured]
    tpots = [
        (r.finish_s - r.first_token_s) / (r.output_tokens - 1)
        if r.finish_s < math.inf
        else math.inf
        for r in measured
        if r.output_tokens > 1
    ]
    prompt = sum(r.prompt_tokens for r in measured)
    hit = sum(r.hit_tokens for r in measured)
    finished = [r for r in measured if r.finish_s < math.inf]
    good = sum(
        1
        for r in finished
        if r.first_token_s - r.arrival_s <= slo.ttft_p99_s
        and (
            r.output_tokens <= 1
            or (r.finish_s - r.first_token_s) / (r.output_tokens - 1) <= slo.tpot_p99_s
        )
    )
    summary = {
        "measured_requests": len(measured),
        "unfinished": len(measured) - len(finished),
        "arrival_rate": len(measured) / window,
        "output_tok_s": sum(r.output_tokens for r in finished) / window,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "tpot_p50_ms": 1000 * percentile(tpots, 50),
        "tpot_p99_ms": 1000 * percentile(tpots, 99),
        "prefix_hit_rate": hit / prompt if prompt else 0.0,
        "mean_prompt_tokens": prompt / len(measured) if measured else 0.0,
        "within_slo_fraction": good / len(measured) if measured else 0.0,
    }
    summary["slo_met"] = (
        summary["unfinished"] == 0
        and summary["ttft_p99_ms"] <= 1000 * slo.ttft_p99_s
        and summary["tpot_p99_ms"] <= 1000 * slo.tpot_p99_s
    )
    return summary
