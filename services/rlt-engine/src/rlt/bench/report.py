"""Print a run's result as a table and save it as JSON (vLLM's layout and key names)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TextIO

from rlt.bench.metrics import LATENCY_METRICS, percentile_key

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency (per chunk)",
    "e2el": "End-to-end Latency",
}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def default_result_filename(
    backend: str, model: str, rate: float, max_concurrency: int | None, date: str
) -> str:
    """vLLM's pattern: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json"""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency else ""
    model_part = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").split("/")[-1]) or "model"
    return f"{backend}-{rate_label(rate)}qps{concurrency}-{model_part}-{date}.json"


def with_rate_suffix(filename: str, rate: float) -> str:
    """a.json -> a-rate4.json (one file per rate of a sweep)."""
    path = Path(filename)
    return str(path.with_name(f"{path.stem}-rate{rate_label(rate)}{path.suffix or '.json'}"))


def save_result(result: dict, result_dir: str | None, filename: str) -> Path:
    path = Path(result_dir or ".") / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _line(out: TextIO, label: str, value) -> None:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    print(f"{label:<40}{text:>10}", file=out)


def print_summary(result: dict, out: TextIO) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=out)
    if result.get("interrupted"):
        print("(interrupted: partial results)", file=out)
    if result.get("num_warmups"):
        _line(out, "Warm-up requests (not measured):", result["num_warmups"])
    _line(out, "Request rate (req/s):", result["request_rate"])
    _line(out, "Successful requests:", result["completed"])
    _line(out, "Failed requests:", result["failed"])
    if result["not_sent"]:
        _line(out, "Requests not sent:", result["not_sent"])
    for kind, count in result["errors_by_kind"].items():
        _line(out, f"  {kind}:", count)
    _line(out, "Maximum request concurrency:", result.get("max_concurrency"))
    _line(out, "Benchmark duration (s):", result["duration"])
    _line(out, "Total input tokens:", result["total_input_tokens"])
    _line(out, "Total generated tokens:", result["total_output_tokens"])
    _line(out, "Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        _line(out, "Request goodput (req/s):", result["request_goodput"])
    _line(out, "Output token throughput (tok/s):", result["output_throughput"])
    _line(out, "Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    _line(out, "Peak concurrent requests:", result["max_concurrent_requests"])
    _line(out, "Total token throughput (tok/s):", result["total_token_throughput"])
    _line(out, "Mean loops per token:", result["mean_loops_per_token"])
    _line(out, "Mean tokens per stream chunk:", result["mean_tokens_per_chunk"])
    for name in result.get("percentile_metrics", LATENCY_METRICS):
        print("{s:{c}^{n}}".format(s=f" {TITLES[name]} ", n=50, c="-"), file=out)
        _line(out, f"Mean {name.upper()} (ms):", result[f"mean_{name}_ms"])
        _line(out, f"Median {name.upper()} (ms):", result[f"median_{name}_ms"])
        for q in result["percentiles"]:
            if q == 50:
                continue  # the median, above
            key = percentile_key(q)
            _line(out, f"P{q:g} {name.upper()} (ms):", result[f"{key}_{name}_ms"])
    print("=" * 50, file=out)


def print_sweep_table(results: list[dict], out: TextIO) -> None:
    header = (
        f"{'rate':>6} {'done':>5} {'fail':>5} {'req/s':>7} {'tok/s':>9} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'E2E p50':>9} {'E2E p99':>9}"
    )
    print(header, file=out)

    def ms(value) -> str:
        return f"{value:9.1f}" if value is not None else f"{'n/a':>9}"

    for r in results:
        print(
            f"{r['request_rate']:>6} {r['completed']:>5} {r['failed']:>5} "
            f"{r['request_throughput']:7.2f} {r['output_throughput']:9.1f} "
            f"{ms(r['median_ttft_ms'])} {ms(r.get('p99_ttft_ms'))} {ms(r['median_tpot_ms'])} "
            f"{ms(r['median_e2el_ms'])} {ms(r.get('p99_e2el_ms'))}",
            file=out,
        )
