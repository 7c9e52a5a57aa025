"""`rlt bench serve`: a load generator and latency/throughput benchmark for any
OpenAI-compatible endpoint (rlt, the PD coordinator, or another server).

Modules, each usable on its own:
- `datasets`: the requests to send (a seeded synthetic length distribution with an optional
  shared prefix, or a JSONL file); `sharegpt`: vLLM's ShareGPT sampling; `tokenizer`: the
  benchmark's own tokenizer (`--tokenizer`), which counts ShareGPT lengths;
- `arrival`: when to send them (Poisson/gamma, constant or burst arrivals at a request rate);
- `request`: send one streaming request and measure it;
- `wire_client`: OpenAI's wire format over HTTP without the SDK's cost per request;
- `runner`: send a whole workload on schedule, with a concurrency cap and a progress bar;
- `metrics`: aggregate the per-request measurements (vLLM's result keys);
- `report`: print and save the results; `plot`: draw a request-rate sweep (matplotlib);
- `cli`: the `rlt bench serve` command line.
"""

from rlt.bench.arrival import arrival_times
from rlt.bench.datasets import BenchRequest, jsonl_requests, random_requests
from rlt.bench.metrics import parse_goodput, percentile, summarize
from rlt.bench.request import Endpoint, RequestResult

__all__ = [
    "BenchRequest",
    "Endpoint",
    "RequestResult",
    "arrival_times",
    "jsonl_requests",
    "parse_goodput",
    "percentile",
    "random_requests",
    "summarize",
]
