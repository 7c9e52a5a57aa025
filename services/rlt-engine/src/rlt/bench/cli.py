"""`rlt bench serve`: benchmark any OpenAI-compatible server (flags follow `vllm bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from datetime import datetime

from rlt_contracts import ConfigurationError
from rlt_serve.exit_codes import EXIT_FAILURE, EXIT_OK, FORCED_EXIT_BASE
from rlt_serve.listening import port_number

from rlt.bench.arrival import ARRIVAL_PROCESSES, parse_rate, parse_rates
from rlt.bench.datasets import DEFAULT_VOCAB_SIZE
from rlt.bench.metrics import parse_goodput, parse_percentile_metrics, parse_percentiles
from rlt.bench.report import print_sweep_table
from rlt.bench.request import BACKENDS, Endpoint, parse_extra_body

DESCRIPTION = """\
Load-test an OpenAI-compatible server (rlt serve, the PD coordinator, vLLM, ...) with
streaming requests and report TTFT, ITL, TPOT, end-to-end latency, throughput, goodput,
errors by kind and (from rlt's exit_depths) mean loops per token. Flags follow
`vllm bench serve`. Fixed concurrency: --request-rate inf --max-concurrency N."""

EPILOG = """\
examples:
  rlt bench serve --num-prompts 200 --request-rate 4 --random-input-len 128 \\
      --random-output-len 32 --ignore-eos --save-result
  rlt bench serve --endpoint /v1/chat/completions --dataset-name jsonl \\
      --dataset-path prompts.jsonl --max-concurrency 8
  rlt bench serve --backend openai-chat --dataset-name sharegpt --tokenizer MODEL_DIR \\
      --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-warmups 8
  rlt bench serve --sweep-request-rates 1,2,4,inf --num-prompts 100 --plot sweep.png"""


INTERRUPTED = FORCED_EXIT_BASE + signal.SIGINT  # 130: Ctrl-C


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url",
        default=None,
        help="server root URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)",
    )
    server.add_argument(
        "--host", default="127.0.0.1", help="server host without --base-url (default: 127.0.0.1)"
    )
    server.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="server port without --base-url (default: 8000)",
    )
    server.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default=None,
        help="vLLM's request kinds: openai (completions; vllm is its older name) or "
        "openai-chat (chat completions) (default: the kind --endpoint takes, openai without it)",
    )
    server.add_argument(
        "--endpoint",
        default=None,
        help="API path ending in /completions or /chat/completions (default: "
        "/v1/chat/completions with --backend openai-chat, else /v1/completions)",
    )
    server.add_argument(
        "--model",
        default=None,
        help="model name to request (default: the first model of GET /v1/models)",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: $OPENAI_API_KEY, else $RLT_API_KEY, else none)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=3600.0,
        help="seconds one request may take before it counts as a timeout (default: 3600)",
    )
    server.add_argument(
        "--trust-env",
        action="store_true",
        help="use proxy settings from the environment (default: connect directly)",
    )

    data = parser.add_argument_group("workload")
    data.add_argument(
        "--dataset-name",
        choices=["random", "jsonl", "sharegpt"],
        default="random",
        help="random: seeded synthetic lengths; jsonl: prompts from --dataset-path; sharegpt: "
        "vLLM's ShareGPT JSON at --dataset-path, lengths counted with --tokenizer "
        "(default: random)",
    )
    data.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl: one {"prompt": ...} or {"messages": [...]} per line, optional '
        '"max_tokens"; sharegpt: a local ShareGPT JSON file (default: none)',
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or Hugging Face id that counts ShareGPT lengths, and the "
        "replies of a server that sends no usage (default: none; sharegpt takes --model's)",
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every ShareGPT request (default: its reference reply's length)",
    )
    data.add_argument(
        "--num-prompts", type=int, default=1000, help="requests per run (default: 1000)"
    )
    data.add_argument(
        "--random-input-len", type=int, default=256, help="mean prompt tokens (default: 256)"
    )
    data.add_argument(
        "--random-output-len", type=int, default=64, help="mean output tokens (default: 64)"
    )
    data.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens (chat: words) of one random prefix that starts every random prompt, "
        "before its --random-input-len (default: 0)",
    )
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0, fixed lengths)",
    )
    data.add_argument(
        "--random-vocab-size",
        type=int,
        default=None,
        help="random token-id prompts use ids in [0, N) (default: the server's vocab_size "
        f"from /v1/models if reported, else {DEFAULT_VOCAB_SIZE})",
    )
    data.add_argument(
        "--jsonl-output-len",
        type=int,
        default=128,
        help="max_tokens of JSONL lines without one (default: 128)",
    )
    data.add_argument(
        "--seed", type=int, default=0, help="seeds the dataset and the arrival times (default: 0)"
    )

    sampling = parser.add_argument_group("request fields")
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)"
    )
    sampling.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: unset)")
    sampling.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (extension of rlt and vLLM) so every output has max_tokens",
    )
    sampling.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="rlt: exit once the gate's cumulative probability reaches this, 1.0 = fixed depth "
        "(default: unset, the server's default)",
    )
    sampling.add_argument(
        "--min-loops",
        type=int,
        default=None,
        help="rlt: a token never exits before this many loops (default: the server's)",
    )
    sampling.add_argument(
        "--max-loops",
        type=int,
        default=None,
        help="rlt: a token always exits at this many loops (default: the server's)",
    )
    sampling.add_argument(
        "--extra-body",
        default=None,
        help="JSON object merged into every request body (other servers' extensions; "
        "default: none)",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=parse_rate,
        default=None,
        help="mean requests per second; inf sends all at once (default: inf)",
    )
    load.add_argument(
        "--arrival",
        choices=ARRIVAL_PROCESSES,
        default="poisson",
        help="poisson (gamma with --burstiness), constant spacing, or bursts of --burst-size",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of poisson gaps: 1 Poisson, <1 burstier, >1 steadier (default: 1)",
    )
    load.add_argument(
        "--burst-size",
        type=int,
        default=8,
        help="requests per burst for --arrival burst (default: 8)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight; arrivals beyond it wait (default: no cap)",
    )
    load.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="copies of the first request sent before the run, not measured (default: 0)",
    )
    load.add_argument(
        "--sweep-request-rates",
        type=parse_rates,
        default=None,
        help="comma-separated rates (e.g. 1,2,4,inf): one run per rate, same prompts "
        "(default: none, one run at --request-rate)",
    )

    out = parser.add_argument_group("metrics and output")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, KEY one of ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50 "
        "(default: none, no goodput)",
    )
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="latency metrics whose percentiles are reported and printed (default: %(default)s)",
    )
    out.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="percentiles reported as pQ_X_ms (default: 50,90,99)",
    )
    out.add_argument("--save-result", action="store_true", help="write each run's result as JSON")
    out.add_argument(
        "--result-dir", default=None, help="folder of the result JSON (default: current)"
    )
    out.add_argument(
        "--result-filename",
        default=None,
        help="result JSON name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json); "
        "a sweep adds -rateR",
    )
    out.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw latency percentiles and throughput against request rate (needs rlt[bench]; "
        "default: none, no plot)",
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar (on stderr)")


def add_bench_parser(commands) -> None:
    """`rlt bench serve` under the `rlt` command's subparsers."""
    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_serve_arguments(serve)
    serve.set_defaults(handler=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    from rlt.bench.session import BenchFailed, BenchSession

    if args.dataset_name != "random" and not args.dataset_path:
        raise ConfigurationError(
            "dataset_path", f"--dataset-name {args.dataset_name} needs --dataset-path"
        )
    tokenizer_id = args.tokenizer
    if args.dataset_name == "sharegpt" and tokenizer_id is None:
        if args.model is None:
            raise ConfigurationError(
                ("tokenizer", "dataset_name"),
                "--dataset-name sharegpt counts prompt and reply tokens: pass --tokenizer "
                "(a tokenizer directory or Hugging Face id; vLLM takes --model's)",
            )
        tokenizer_id = args.model
    if args.num_warmups < 0:
        raise ConfigurationError("num_warmups", f"must be >= 0, got {args.num_warmups}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigurationError("max_concurrency", f"must be >= 1, got {args.max_concurrency}")
    if args.request_timeout <= 0:
        raise ConfigurationError("request_timeout", "must be > 0")
    if args.sweep_request_rates is not None:
        if not args.sweep_request_rates:
            raise ConfigurationError("sweep_request_rates", "give at least one rate")
        if args.request_rate is not None:
            raise ConfigurationError(
                ("request_rate", "sweep_request_rates"), "give one or the other"
            )
    endpoint = Endpoint.resolve(
        args.base_url or f"http://{args.host}:{args.port}", args.endpoint, args.backend
    )
    if args.plot:
        from rlt.bench.plot import require_matplotlib

        require_matplotlib()  # before the run, not after it
    api_key = (
        args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("RLT_API_KEY") or "none"
    )
    options = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
        exit_threshold=args.exit_threshold,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        extra_body=parse_extra_body(args.extra_body),
    )
    session = BenchSession(
        args=args,
        endpoint=endpoint,
        api_key=api_key,
        options=options,
        percentiles=parse_percentiles(args.metric_percentiles),
        goodput=parse_goodput(args.goodput),
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        percentile_metrics=parse_percentile_metrics(args.percentile_metrics),
        tokenizer_id=tokenizer_id,
    )
    rates = args.sweep_request_rates or [
        math.inf if args.request_rate is None else args.request_rate
    ]
    try:
        results = asyncio.run(session.run(rates))
    except KeyboardInterrupt:  # outside a run (runs end cleanly and keep their results)
        print("rlt bench serve: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BenchFailed as exc:  # the test request, or every request of a run, failed
        print(f"rlt bench serve: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if len(results) > 1:
        print_sweep_table(results, sys.stdout)
    if args.plot:
        from rlt.bench.plot import plot_sweep

        path = plot_sweep(results, args.plot, title=f"{session.model} at {endpoint.path}")
        print(f"plot written to {path}")
    return INTERRUPTED if any(r["interrupted"] for r in results) else EXIT_OK
