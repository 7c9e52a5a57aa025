"""When each request is sent: seconds after the start of the run, a non-decreasing list.

- `poisson` (default): exponential gaps of mean 1/rate; with `burstiness` != 1 the gaps are
  gamma-distributed with shape `burstiness` and the same mean (vLLM's `--burstiness`:
  below 1 burstier, above 1 more regular).
- `constant`: one request every 1/rate seconds.
- `burst`: groups of `burst_size` requests sent together, a group every burst_size/rate seconds
  (so the mean rate is still `rate`).

A rate of `inf` sends everything at time 0 (with `--max-concurrency` that is fixed
concurrency). The first request always goes at 0; the schedule depends only on its arguments.
"""

from __future__ import annotations

import argparse
import math
import random

from rlt_contracts import ConfigurationError

ARRIVAL_PROCESSES = ("poisson", "constant", "burst")


def arrival_times(
    num_requests: int,
    request_rate: float,
    *,
    process: str = "poisson",
    burstiness: float = 1.0,
    burst_size: int = 1,
    seed: int = 0,
) -> list[float]:
    if num_requests < 0:
        raise ConfigurationError("num_prompts", f"must be >= 0, got {num_requests}")
    if not request_rate > 0:  # also refuses NaN
        raise ConfigurationError("request_rate", f"must be > 0 (or inf), got {request_rate}")
    if process not in ARRIVAL_PROCESSES:
        raise ConfigurationError("arrival", f"one of {ARRIVAL_PROCESSES}, got {process!r}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ConfigurationError("burstiness", f"must be a finite number > 0, got {burstiness}")
    if burst_size < 1:
        raise ConfigurationError("burst_size", f"must be >= 1, got {burst_size}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if process == "constant":
        return [i / request_rate for i in range(num_requests)]
    if process == "burst":
        return [(i // burst_size) * burst_size / request_rate for i in range(num_requests)]
    # A string seed is hashed deterministically (sha512), independent of PYTHONHASHSEED; it
    # keeps this stream apart from the dataset's, which is seeded with the integer itself.
    rng = random.Random(f"arrival:{seed}")
    scale = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or inf: {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf): {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    return [parse_rate(part) for part in text.split(",") if part.strip()]
