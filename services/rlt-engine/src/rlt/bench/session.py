"""One `rlt bench serve` invocation: find the model, build the workload once, send its first
request alone (the test request) and `--num-warmups` copies of it (not measured), then run it
at each request rate (one rate, or a sweep), printing and saving each run's result."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rlt_contracts import RltError

from rlt.bench.arrival import arrival_times
from rlt.bench.datasets import DEFAULT_VOCAB_SIZE, BenchRequest, jsonl_requests, random_requests
from rlt.bench.metrics import LATENCY_METRICS, summarize
from rlt.bench.report import (
    default_result_filename,
    print_summary,
    rate_label,
    save_result,
    with_rate_suffix,
)
from rlt.bench.request import Endpoint, RequestOptions, RequestResult, send_request
from rlt.bench.runner import make_client, run_requests


class BenchFailed(RltError):
    """Nothing could be measured: the server listed no model or could not be reached, the test
    request failed, or no request of a run succeeded (`rlt bench serve` exits 1 with this
    message; bad flags exit 2)."""


def backend_name(args, endpoint: Endpoint) -> str:
    """`--backend` as given, else the one `--endpoint` implies."""
    return args.backend or ("openai-chat" if endpoint.chat else "openai")


def build_requests(
    args: argparse.Namespace, *, chat: bool, vocab_size: int, tokenizer=None
) -> list:
    if args.dataset_name == "sharegpt":
        from rlt.bench.sharegpt import sharegpt_requests

        return sharegpt_requests(
            args.dataset_path,
            args.num_prompts,
            chat=chat,
            tokenizer=tokenizer,
            output_len=args.sharegpt_output_len,
            seed=args.seed,
        )
    if args.dataset_name == "jsonl":
        return jsonl_requests(
            args.dataset_path,
            args.num_prompts,
            chat=chat,
            default_output_len=args.jsonl_output_len,
        )
    return random_requests(
        args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        chat=chat,
        range_ratio=args.random_range_ratio,
        vocab_size=vocab_size,
        seed=args.seed,
        prefix_len=args.random_prefix_len,
    )


# the flags a result records as they were given (vLLM's keys): before its request_rate, after it
FLAGS_BEFORE_RATE = (
    "num_prompts num_warmups dataset_name dataset_path random_input_len random_output_len "
    "random_range_ratio random_prefix_len sharegpt_output_len"
).split()
FLAGS_AFTER_RATE = (
    "arrival burstiness burst_size max_concurrency seed temperature top_p ignore_eos "
    "exit_threshold min_loops max_loops"
).split()


def result_metadata(
    args, endpoint: Endpoint, model: str, rate: float, date: str, tokenizer_id: str | None
) -> dict:
    backend = backend_name(args, endpoint)
    return {
        "date": date,
        "endpoint_type": backend,  # vLLM writes both names
        "backend": backend,
        "label": None,
        "base_url": endpoint.base_url,
        "endpoint": endpoint.path,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        **{key: getattr(args, key) for key in FLAGS_BEFORE_RATE},
        "request_rate": rate_label(rate) if math.isinf(rate) else rate,
        **{key: getattr(args, key) for key in FLAGS_AFTER_RATE},
    }


def result_filename(args, endpoint: Endpoint, model: str, rate: float, date: str, sweep: bool):
    if args.result_filename:
        return with_rate_suffix(args.result_filename, rate) if sweep else args.result_filename
    return default_result_filename(
        backend_name(args, endpoint), model, rate, args.max_concurrency, date
    )


@dataclass
class BenchSession:
    args: argparse.Namespace
    endpoint: Endpoint
    api_key: str
    options: dict[str, Any]  # RequestOptions fields but the model
    percentiles: tuple[float, ...]
    goodput: dict[str, float]
    date: str
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS
    tokenizer_id: str | None = None  # --tokenizer, else --model for a ShareGPT workload
    model: str | None = None
    results: list[dict] = field(default_factory=list)
    tokenizer: Any = None

    async def _discover(self, client) -> int:
        """Fill in the model (if not given); return the vocabulary size for random prompts."""
        args = self.args
        cards: list[dict] = []
        if args.model is None or args.random_vocab_size is None:
            try:
                cards = await client.list_models()
            except Exception as exc:
                if args.model is None:
                    raise BenchFailed(
                        f"cannot list models at {self.endpoint.api_base}/models "
                        f"({type(exc).__name__}: {exc}); is the server up? "
                        "Otherwise pass --model"
                    ) from None
        if args.model is None and not cards:
            raise BenchFailed("the server lists no model; pass --model")
        self.model = args.model or cards[0]["id"]
        if args.random_vocab_size is not None:
            return args.random_vocab_size
        card = next((c for c in cards if c.get("id") == self.model), {})
        vocab = card.get("vocab_size")
        return vocab if isinstance(vocab, int) and vocab > 0 else DEFAULT_VOCAB_SIZE

    async def run(self, rates: list[float]) -> list[dict]:
        args = self.args
        client = make_client(
            self.endpoint,
            api_key=self.api_key,
            timeout=args.request_timeout,
            trust_env=args.trust_env,
        )
        async with client:
            vocab_size = await self._discover(client)
            if self.tokenizer_id is not None:
                from rlt.bench.tokenizer import load_bench_tokenizer

                self.tokenizer = load_bench_tokenizer(self.tokenizer_id)
            requests = build_requests(
                args, chat=self.endpoint.chat, vocab_size=vocab_size, tokenizer=self.tokenizer
            )
            options = RequestOptions(model=self.model, **self.options)
            if requests:
                await self._test_request(client, requests[0], options)
                await self._warm_up(client, requests[0], options)
            for rate in rates:
                result = await self._run_rate(client, requests, options, rate, len(rates) > 1)
                self.results.append(result)
                if result["interrupted"]:
                    break
                if requests and result["completed"] == 0:
                    raise BenchFailed(
                        f"no request of the run at rate {rate_label(rate)} succeeded "
                        f"(failed: {result['errors_by_kind']}; the first error: "
                        f"{next((e for e in result['errors'] if e), 'none recorded')})"
                    )
        return self.results

    async def _test_request(self, client, request: BenchRequest, options: RequestOptions):
        """As `vllm bench serve`: the workload's first request alone before the run, so that
        a wrong model name, endpoint or field fails at once with the server's own error."""
        print("test request: sending the first request alone", file=sys.stderr)
        result = await send_request(
            client, self.endpoint, request, options, RequestResult(index=0), time.perf_counter()
        )
        if not result.success:
            raise BenchFailed(
                f"the test request to {self.endpoint.base_url}{self.endpoint.path} failed "
                f"({result.error_kind}: {result.error}); check the server and the flags"
            )
        print(f"test request: ok in {result.latency:.2f} s; starting the run", file=sys.stderr)

    async def _warm_up(self, client, request: BenchRequest, options: RequestOptions):
        """As `vllm bench serve --num-warmups N`: N copies of the first request, at most
        --max-concurrency at a time, before the measured runs (which they are not part of)."""
        count = self.args.num_warmups
        if count < 1:
            return
        print(f"warm-up: {count} requests", file=sys.stderr)
        cap = self.args.max_concurrency
        slots = asyncio.Semaphore(cap) if cap else None

        async def one(index: int) -> RequestResult:
            async with slots if slots is not None else contextlib.nullcontext():
                return await send_request(
                    client,
                    self.endpoint,
                    request,
                    options,
                    RequestResult(index=index),
                    time.perf_counter(),
                )

        results = await asyncio.gather(*(one(i) for i in range(count)))
        failed = [r for r in results if not r.success]
        note = (
            f"; {len(failed)} failed ({failed[0].error_kind}: {failed[0].error})" if failed else ""
        )
        print(f"warm-up: done{note}", file=sys.stderr)

    def _count_with_tokenizer(self, results) -> None:
        """Replies of a server that sent no usage: their tokens counted with --tokenizer
        (vLLM's count) instead of one per text chunk; prompts from the dataset's lengths."""
        from rlt.bench.tokenizer import count_tokens

        for result in results:
            if result is not None and result.success and not result.usage_reported:
                result.output_tokens = count_tokens(self.tokenizer, result.generated_text)

    async def _run_rate(
        self, client, requests: list[BenchRequest], options: RequestOptions, rate, sweep: bool
    ) -> dict:
        from tqdm import tqdm

        args = self.args
        arrivals = arrival_times(
            len(requests),
            rate,
            process=args.arrival,
            burstiness=args.burstiness,
            burst_size=args.burst_size,
            seed=args.seed,
        )
        with tqdm(
            total=len(requests),
            desc=f"rate {rate_label(rate)}",
            unit="req",
            disable=args.disable_tqdm,
            file=sys.stderr,
        ) as progress:
            outcome = await run_requests(
                client,
                self.endpoint,
                requests,
                arrivals,
                options,
                max_concurrency=args.max_concurrency,
                progress=progress,
            )
        if self.tokenizer is not None:
            self._count_with_tokenizer(outcome.results)
        result = result_metadata(
            args, self.endpoint, self.model, rate, self.date, self.tokenizer_id
        )
        result.update(
            interrupted=outcome.interrupted,
            percentiles=list(self.percentiles),
            percentile_metrics=list(self.percentile_metrics),
        )
        # the run's start on the machine's monotonic clock: lines a server's step log
        # (RLT_STEP_LOG, same clock) up with the requests' start_times
        result["started_perf_counter_s"] = outcome.started_s
        result.update(
            summarize(
                outcome.results,
                outcome.duration,
                percentiles=self.percentiles,
                goodput_slos=self.goodput,
                percentile_metrics=self.percentile_metrics,
            )
        )
        print_summary(result, sys.stdout)
        if args.save_result:
            name = result_filename(args, self.endpoint, self.model, rate, self.date, sweep)
            path = save_result(result, args.result_dir, name)
            print(f"result written to {path}")
        return result
