"""`rlt bench serve`: aggregation, percentiles, goodput, arrival seeding, datasets and the
command line without a server; then the benchmark against a live `rlt serve` (CPU, bundled
model): every request accounted for, percentiles ordered, token counts equal to the server's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import signal
import statistics
import sys
from types import SimpleNamespace

import pytest
from rlt.bench import (
    BenchRequest,
    Endpoint,
    RequestResult,
    arrival_times,
    jsonl_requests,
    parse_goodput,
    percentile,
    random_requests,
    summarize,
)
from rlt.bench.metrics import LATENCY_METRICS, parse_percentiles
from rlt.bench.plot import plot_sweep, require_matplotlib
from rlt.bench.request import RequestOptions, send_request
from rlt.bench.runner import run_requests
from rlt.cli import build_parser, main
from rlt_contracts import ConfigurationError
from rlt_serve.exit_codes import EXIT_FAILURE

# -- percentiles and aggregation ---------------------------------------------------------------


def test_percentile_interpolates_linearly_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def done(index, ttft, itls, output_tokens, *, depths=None, prompt=10, start=0.0):
    latency = ttft + sum(itls)
    return RequestResult(
        index=index,
        start=start,
        success=True,
        ttft=ttft,
        itls=list(itls),
        chunk_tokens=[1] * (len(itls) + 1),
        latency=latency,
        prompt_tokens=prompt,
        output_tokens=output_tokens,
        tokens_seen=output_tokens,
        exact_token_count=depths is not None,
        usage_reported=True,
        exit_depths=depths or [],
        finish_reason="length",
    )


def failed(index, kind):
    return RequestResult(index=index, error_kind=kind, error=f"{kind}!")


def test_summarize_counts_tokens_errors_and_throughput():
    results = [
        done(0, 0.1, [0.02, 0.02, 0.02], 4, depths=[4, 2, 3, 1]),
        done(1, 0.3, [0.05], 2, depths=[4, 4]),
        done(2, 0.2, [], 1, depths=[4]),  # one token: no TPOT, no ITL
        failed(3, "http_429"),
        failed(4, "http_429"),
        failed(5, "timeout"),
        None,  # never sent (interrupted)
    ]
    s = summarize(results, 2.0, percentiles=(50, 90, 99))
    assert (s["completed"], s["failed"], s["not_sent"]) == (3, 3, 1)
    assert s["errors_by_kind"] == {"http_429": 2, "timeout": 1}
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.5
    assert s["total_token_throughput"] == pytest.approx(37 / 2)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0) == s["p50_ttft_ms"]
    # TPOT: (e2e - ttft) / (n - 1) = 0.02 and 0.05; the one-token request has none
    assert s["mean_tpot_ms"] == pytest.approx(35.0)
    assert s["max_itl_ms"] == pytest.approx(50.0) and s["min_itl_ms"] == pytest.approx(20.0)
    assert s["mean_itl_ms"] == pytest.approx((3 * 20 + 50) / 4)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    # decoded tokens only (token 0 comes from prefill): depths 2, 3, 1 and 4
    assert s["mean_loops_per_token"] == pytest.approx(10 / 4)
    assert s["token_count_mismatches"] == 0
    assert s["output_lens"] == [4, 2, 1, None, None, None, None]
    assert s["error_kinds"] == [None, None, None, "http_429", "http_429", "timeout", "not_sent"]
    assert s["ttfts"][:3] == [0.1, 0.3, 0.2] and s["ttfts"][3] is None
    assert s["tpots"][2] is None and s["tpots"][0] == pytest.approx(0.02)
    assert s["loops_per_token"] == [pytest.approx(2.0), 4.0, None, None, None, None, None]
    assert len(s["itls"]) == 7 and s["itls"][0] == [0.02, 0.02, 0.02]
    assert s["request_goodput"] is None  # vLLM writes the key, null without --goodput


def test_summarize_of_nothing_completed_has_no_statistics():
    s = summarize([failed(0, "connection_error")], 1.0)
    assert (s["completed"], s["failed"]) == (0, 1)
    for name in LATENCY_METRICS:
        assert s[f"mean_{name}_ms"] is None and s[f"p99_{name}_ms"] is None
    assert s["mean_loops_per_token"] is None and s["output_throughput"] == 0.0
    json.dumps(s, allow_nan=False)


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        done(0, 0.1, [0.01] * 4, 5),  # ttft 100, tpot 10, e2el 140
        done(1, 0.4, [0.01] * 4, 5),  # ttft 400: misses ttft:300
        done(2, 0.1, [0.05] * 4, 5),  # tpot 50: misses tpot:20
        done(3, 0.25, [], 1),  # one token: passes the TPOT SLO
        failed(4, "http_500"),  # never good
    ]
    slos = parse_goodput(["ttft:300", "tpot:20"])
    assert slos == {"ttft": 300.0, "tpot": 20.0}
    s = summarize(results, 2.0, goodput_slos=slos)
    assert s["good_requests"] == 2 and s["request_goodput"] == 1.0
    assert s["goodput_slos_ms"] == slos
    s = summarize(results, 2.0, goodput_slos=parse_goodput(["e2el:150"]))
    assert s["good_requests"] == 1  # e2el 140; the others take 440, 300 and 250 ms


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:fast", "tpot:-1"])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ConfigurationError, match="goodput"):
        parse_goodput([bad])


def test_metric_percentiles_parse():
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ConfigurationError):
        parse_percentiles("50,100")


# -- arrivals and datasets ---------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_have_the_requested_rate():
    first = arrival_times(4000, 8.0, seed=3)
    assert first == arrival_times(4000, 8.0, seed=3)
    assert first != arrival_times(4000, 8.0, seed=4)
    assert first[0] == 0.0 and first == sorted(first)
    gaps = [b - a for a, b in zip(first, first[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.06)
    # exponential gaps: coefficient of variation 1; gamma(shape k): 1/sqrt(k)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.08)
    steady = arrival_times(4000, 8.0, burstiness=4.0, seed=3)
    steady_gaps = [b - a for a, b in zip(steady, steady[1:], strict=False)]
    assert statistics.fmean(steady_gaps) == pytest.approx(1 / 8, rel=0.06)
    assert statistics.stdev(steady_gaps) / statistics.fmean(steady_gaps) == pytest.approx(
        0.5, rel=0.1
    )


def test_constant_burst_and_infinite_arrivals():
    assert arrival_times(4, 2.0, process="constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(5, 4.0, process="burst", burst_size=2) == [0.0, 0.0, 0.5, 0.5, 1.0]
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigurationError):
        arrival_times(3, 0.0)
    with pytest.raises(ConfigurationError):
        arrival_times(3, 1.0, burstiness=0.0)


def test_random_dataset_is_seeded_and_within_bounds():
    make = dict(input_len=20, output_len=10, chat=False, range_ratio=0.5, vocab_size=50, seed=7)
    requests = random_requests(200, **make)
    assert requests == random_requests(200, **make)
    assert requests != random_requests(200, **{**make, "seed": 8})
    assert all(10 <= len(r.prompt) <= 30 and r.prompt_len == len(r.prompt) for r in requests)
    assert all(5 <= r.output_len <= 15 for r in requests)
    assert all(0 <= t < 50 for r in requests for t in r.prompt)
    assert len({len(r.prompt) for r in requests}) > 5
    fixed = random_requests(3, input_len=6, output_len=4, chat=True)
    assert all(r.prompt is None and len(r.messages[0]["content"].split()) == 6 for r in fixed)
    assert {r.output_len for r in fixed} == {4}


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Hello", "max_tokens": 3},
        {"prompt": [5, 6, 7]},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    requests = jsonl_requests(path, 5, chat=False, default_output_len=9)
    assert [r.prompt for r in requests] == ["Hello", [5, 6, 7], "Hello", [5, 6, 7], "Hello"]
    assert [r.output_len for r in requests] == [3, 9, 3, 9, 3]
    assert [r.index for r in requests] == [0, 1, 2, 3, 4]
    chat_path = tmp_path / "chat.jsonl"
    chat_path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[2]) + "\n")
    chat = jsonl_requests(chat_path, 2, chat=True, default_output_len=9)
    assert chat[0].messages == [{"role": "user", "content": "Hello"}]
    assert chat[1].messages == lines[2]["messages"] and chat[1].output_len == 2
    with pytest.raises(ConfigurationError, match="line 2"):
        jsonl_requests(chat_path, 2, chat=False, default_output_len=9)  # messages need chat
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ConfigurationError, match="line 2"):
        jsonl_requests(path, 1, chat=False, default_output_len=9)


def test_endpoint_parsing():
    completions = Endpoint.parse("http://127.0.0.1:8000/", "/v1/completions")
    assert not completions.chat and completions.api_base == "http://127.0.0.1:8000/v1"
    chat = Endpoint.parse("http://h:1", "v1/chat/completions")
    assert chat.chat and chat.api_base == "http://h:1/v1"
    with pytest.raises(ConfigurationError, match="endpoint"):
        Endpoint.parse("http://h:1", "/v1/embeddings")
    with pytest.raises(ConfigurationError, match="base_url"):
        Endpoint.parse("h:1", "/v1/completions")


# -- one request's measurement and interruption, with a scripted client -----------------------


class ScriptedStream:
    """Stands in for the openai client's AsyncStream: yields chunks after given delays."""

    def __init__(self, script):
        self.script = script

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        return None

    async def __aiter__(self):
        for delay, chunk in self.script:
            await asyncio.sleep(delay)
            yield chunk


def chunk(text, depths=None, finish=None):
    choice = SimpleNamespace(
        text=text,
        finish_reason=finish,
        model_extra={} if depths is None else {"exit_depths": depths},
    )
    return SimpleNamespace(choices=[choice], usage=None)


def usage_chunk(prompt, completion):
    usage = SimpleNamespace(prompt_tokens=prompt, completion_tokens=completion)
    return SimpleNamespace(choices=[], usage=usage)


class ScriptedClient:
    def __init__(self, script=None):
        self.script = script
        self.completions = SimpleNamespace(create=self.create)
        self.bodies = []

    async def create(self, **body):
        self.bodies.append(body)
        if self.script is None:
            await asyncio.sleep(3600)  # a request that never answers
        return ScriptedStream(self.script)


ENDPOINT = Endpoint.parse("http://127.0.0.1:1", "/v1/completions")
OPTIONS = RequestOptions(model="m", ignore_eos=True, exit_threshold=0.5, max_loops=4)


def test_multi_token_chunks_give_one_gap_each_and_exact_counts():
    script = [
        (0.05, chunk("It", [4])),
        (0.02, chunk("", [2, 3])),  # two tokens, text held back: still a token chunk
        (0.02, chunk(" is", [1], finish="length")),
        (0.0, usage_chunk(7, 4)),
    ]
    client = ScriptedClient(script)
    request = BenchRequest(0, 4, prompt=[1, 2, 3], prompt_len=3)
    result = RequestResult(index=0)
    asyncio.run(send_request(client, ENDPOINT, request, OPTIONS, result, 0.0))
    [body] = client.bodies
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["extra_body"] == {"ignore_eos": True, "exit_threshold": 0.5, "max_loops": 4}
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4
    assert result.success and result.finish_reason == "length"
    assert result.chunk_tokens == [1, 2, 1] and len(result.itls) == 2
    assert result.tokens_seen == result.output_tokens == 4 and result.exact_token_count
    assert result.prompt_tokens == 7 and result.loops_per_token == 2.0
    assert result.ttft == pytest.approx(0.05, abs=0.04)
    assert result.tpot == pytest.approx((result.latency - result.ttft) / 3)


def test_sigint_stops_the_run_with_partial_results():
    requests = random_requests(4, input_len=3, output_len=2, chat=False)

    async def interrupted_run():
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, signal.raise_signal, signal.SIGINT)
        return await run_requests(ScriptedClient(), ENDPOINT, requests, [0, 0, 60, 60], OPTIONS)

    outcome = asyncio.run(interrupted_run())
    assert outcome.interrupted and outcome.duration < 30
    assert [r and r.error_kind for r in outcome.results] == ["cancelled", "cancelled", None, None]
    s = summarize(outcome.results, outcome.duration)
    assert (s["completed"], s["failed"], s["not_sent"]) == (0, 2, 2)


# -- the command line --------------------------------------------------------------------------


def bench_serve_parser():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    bench = commands.choices["bench"]
    kinds = next(a for a in bench._actions if a.dest == "bench_command")
    return kinds.choices["serve"]


def test_help_documents_every_option(capsys):
    parser = bench_serve_parser()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    options = [a for a in parser._actions if a.option_strings]
    assert len(options) > 30
    for action in options:
        assert action.help, f"{action.option_strings} has no help"
        assert all(flag in text for flag in action.option_strings)
    vllm_flags = (
        "--base-url --endpoint --model --dataset-name --dataset-path --random-input-len "
        "--random-output-len --num-prompts --request-rate --max-concurrency --seed "
        "--save-result --result-filename --burstiness --goodput --ignore-eos"
    ).split()
    assert all(f"{flag} " in text for flag in vllm_flags)


def test_plot_needs_matplotlib_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ConfigurationError, match=r"rlt\[bench\]") as error:
        require_matplotlib()
    assert "uv run --with matplotlib rlt bench serve" in str(error.value)  # what works here


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is rlt's optional `bench` extra, not installed here",
)
def test_plot_of_a_sweep(tmp_path):
    results = []
    for rate, scale in ((1.0, 1.0), (4.0, 2.0), ("inf", 5.0)):
        row = {"request_rate": rate, "output_throughput": 10 * scale, "request_throughput": scale}
        for metric in LATENCY_METRICS:
            row[f"median_{metric}_ms"] = 10 * scale
            row[f"p99_{metric}_ms"] = 20 * scale
        results.append(row)
    path = plot_sweep(results, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- against a live `rlt serve` (CPU, bundled model) ---------------------------------------------


@pytest.fixture(scope="module")
def live_server():
    from rlt.engine.assembly import DEFAULT_MODEL_DIR
    from serving_harness import run_server

    with run_server(DEFAULT_MODEL_DIR) as running:
        yield running


def server_token_totals(server) -> dict[str, int]:
    """The engine's own prompt/generation token counters (what its `usage` fields add up to)."""
    stats = server.client.stats()
    return {"prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens}


def run_bench(server, tmp_path, *flags) -> tuple[int, dict, dict]:
    """Run `rlt bench serve` in-process; (exit code, result JSON, server token deltas of the
    run: without its test request, the workload's first request sent alone before it)."""
    before = server_token_totals(server)
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--save-result"]
        + ["--result-dir", str(tmp_path), "--result-filename", "run.json", *flags]
    )
    after = server_token_totals(server)
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["output_lens"][0] is not None  # the test request's twin (greedy) succeeded
    test_request = {
        "prompt_tokens": result["input_lens"][0],
        "generation_tokens": result["output_lens"][0],
    }
    return code, result, {name: after[name] - before[name] - test_request[name] for name in after}


def assert_statistics_ordered(result: dict) -> None:
    for name in LATENCY_METRICS:
        low, high = result[f"min_{name}_ms"], result[f"max_{name}_ms"]
        p50, p90, p99 = (result[f"p{q}_{name}_ms"] for q in (50, 90, 99))
        assert 0 <= low <= p50 <= p90 <= p99 <= high, name
        assert low <= result[f"mean_{name}_ms"] <= high, name
        assert result[f"median_{name}_ms"] == p50


def test_live_completions_30_requests_at_a_fixed_rate(live_server, tmp_path, capsys):
    code, result, server = run_bench(
        live_server,
        tmp_path,
        *"--num-prompts 30 --request-rate 20 --arrival constant --random-input-len 24".split(),
        *"--random-output-len 8 --ignore-eos --exit-threshold 0.5 --min-loops 1".split(),
        *"--goodput e2el:600000 --seed 1".split(),
    )
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert (result["completed"], result["failed"], result["not_sent"]) == (30, 0, 0)
    assert result["errors_by_kind"] == {} and not result["interrupted"]
    assert result["request_rate"] == 20.0 and result["model_id"] == "default_model"
    assert_statistics_ordered(result)
    assert result["output_lens"] == [8] * 30 and result["input_lens"] == [24] * 30
    assert result["total_output_tokens"] == 240 == server["generation_tokens"]
    assert result["total_input_tokens"] == 720 == server["prompt_tokens"]
    assert result["token_count_mismatches"] == 0  # exit_depths counted = usage, per request
    assert sum(sum(chunks) for chunks in result["chunk_tokens"]) == 240
    assert 1.0 <= result["mean_loops_per_token"] <= 4.0
    assert all(1.0 <= x <= 4.0 for x in result["loops_per_token"])
    assert result["good_requests"] == 30
    assert all(
        len(gaps) == len(chunks) - 1
        for gaps, chunks in zip(result["itls"], result["chunk_tokens"], strict=True)
    )
    # constant arrivals 50 ms apart: each request is sent at its slot or later, never earlier
    assert all(start >= i * 0.05 - 0.005 for i, start in enumerate(result["start_times"]))
    assert result["duration"] >= 29 / 20


def test_live_chat_at_fixed_concurrency_from_jsonl(live_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "It is a truth universally acknowledged", "max_tokens": 5}\n'
        '{"messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Where are we going?"}]}\n'
    )
    code, result, server = run_bench(
        live_server,
        tmp_path,
        *"--endpoint /v1/chat/completions --dataset-name jsonl --num-prompts 8".split(),
        *f"--dataset-path {prompts} --jsonl-output-len 7 --max-concurrency 3".split(),
    )
    assert code == 0 and (result["completed"], result["failed"]) == (8, 0)
    assert result["backend"] == "openai-chat" and result["request_rate"] == "inf"
    assert_statistics_ordered(result)
    assert result["total_output_tokens"] == server["generation_tokens"]
    assert result["total_input_tokens"] == server["prompt_tokens"]
    assert result["token_count_mismatches"] == 0
    assert all(n <= cap for n, cap in zip(result["output_lens"], [5, 7] * 4, strict=True))
    assert 1.0 <= result["mean_loops_per_token"] <= 4.0
    spans = [(s, s + e) for s, e in zip(result["start_times"], result["e2els"], strict=True)]
    in_flight = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert in_flight <= 3


def test_live_server_errors_are_counted_not_raised(live_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(  # every other request asks for more tokens than the context holds: 400
        '{"prompt": "It is a truth", "max_tokens": 3}\n'
        '{"prompt": "It is a truth", "max_tokens": 100000}\n'
    )
    code, result, server = run_bench(
        live_server,
        tmp_path,
        *f"--dataset-name jsonl --dataset-path {prompts} --num-prompts 6".split(),
    )
    assert code == 0
    assert (result["completed"], result["failed"]) == (3, 3)
    assert result["errors_by_kind"] == {"http_400": 3}
    assert all("400" in message for message in result["errors"][1::2])
    assert server["generation_tokens"] == result["total_output_tokens"] > 0


def test_live_a_failing_test_request_stops_the_benchmark_before_the_run(
    live_server, tmp_path, capsys
):
    """As `vllm bench serve`: the first request goes alone first; its error ends the command
    (exit 1, the server's error in the message) before any run, and no result is written."""
    before = server_token_totals(live_server)
    code = main(
        ["bench", "serve", "--base-url", live_server.base_url, "--disable-tqdm", "--save-result"]
        + ["--result-dir", str(tmp_path), "--num-prompts", "5", "--random-input-len", "8"]
        + ["--random-vocab-size", "1000000"]  # ids beyond the vocabulary: 400
    )
    assert code == EXIT_FAILURE
    error = capsys.readouterr().err
    assert "rlt bench serve: error: the test request to" in error
    assert "http_400" in error and "prompt" in error
    assert server_token_totals(live_server) == before
    assert list(tmp_path.iterdir()) == []


def test_live_sweep_runs_each_rate_and_saves_each_result(live_server, tmp_path, capsys):
    code = main(
        ["bench", "serve", "--base-url", live_server.base_url, "--disable-tqdm", "--save-result"]
        + ["--result-dir", str(tmp_path), "--result-filename", "sweep.json"]
        + "--num-prompts 4 --random-input-len 8 --random-output-len 3 --ignore-eos".split()
        + ["--sweep-request-rates", "50,inf"]
    )
    assert code == 0
    assert "rate  done  fail" in capsys.readouterr().out
    for name, rate in (("sweep-rate50.json", 50.0), ("sweep-rateinf.json", "inf")):
        result = json.loads((tmp_path / name).read_text())
        assert result["request_rate"] == rate and result["completed"] == 4
        assert result["total_output_tokens"] == 12


def scrape_metrics(server) -> dict[str, float]:
    """{sample name: value} of the server's `rlt:` samples without extra labels."""
    from serving_harness import metric_samples

    with server.http() as http:
        text = http.get("/metrics").text
    values = {}
    for name, labels, value in metric_samples(text):
        labels.pop("model_name", None)
        if name.startswith("rlt:") and not labels:
            values[name] = value
    return values


def test_server_metrics_agree_with_the_benchmarks_own_counts(live_server, tmp_path, monkeypatch):
    """After a benchmark run, every per-request and per-token histogram of /metrics moved by
    exactly what the benchmark counted (and the loops histogram by its exit depths); `before`
    is scraped once the test request (sent alone before the run) finished."""
    from rlt.bench.session import BenchSession

    before = {}
    test_request = BenchSession._test_request

    async def scrape_after_the_test_request(self, *args):
        await test_request(self, *args)
        before.update(scrape_metrics(live_server))

    monkeypatch.setattr(BenchSession, "_test_request", scrape_after_the_test_request)
    code, result, _ = run_bench(
        live_server,
        tmp_path,
        *"--num-prompts 12 --request-rate inf --max-concurrency 4 --random-input-len 16".split(),
        *"--random-output-len 6 --ignore-eos --exit-threshold 0.5 --min-loops 1 --seed 2".split(),
    )
    after = scrape_metrics(live_server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert code == 0 and (result["completed"], result["failed"]) == (12, 0)
    requests, tokens = result["completed"], result["total_output_tokens"]
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_generation_tokens",
    ):
        assert moved(f"rlt:{name}_count") == requests, name
    assert moved("rlt:inter_token_latency_seconds_count") == tokens - requests
    assert moved("rlt:generation_tokens_total") == tokens
    assert moved("rlt:request_generation_tokens_sum") == tokens
    assert moved("rlt:prompt_tokens_total") == result["total_input_tokens"]
    # decoded tokens (all but token 0 of each request) and their exit depths
    assert moved("rlt:loops_per_token_count") == tokens - requests
    decoded_loops = sum(
        mean * (n - 1)
        for mean, n in zip(result["loops_per_token"], result["output_lens"], strict=True)
    )
    assert moved("rlt:loops_per_token_sum") == pytest.approx(decoded_loops)
    assert moved("rlt:decode_loops_total") == pytest.approx(decoded_loops)


# -- the wire client: the server's bytes in, the measured request out ----------------------------


def wire_client(handler):
    import httpx2
    from rlt.bench.wire_client import WireClient

    client = WireClient("http://bench.test/v1", api_key="k", timeout=5, trust_env=False)
    client._http = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    return client


def sse(*events) -> bytes:
    """Server-sent events; one starting with ":" is a comment line."""
    return b"".join((e if e.startswith(":") else f"data: {e}").encode() + b"\n\n" for e in events)


def test_the_wire_client_sends_the_body_and_reads_chunks_usage_and_depths():
    import httpx2

    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content), request.headers))
        events = [
            json.dumps({"choices": [{"index": 0, "text": "It", "exit_depths": [4]}]}),
            ": a comment line",
            json.dumps(
                {
                    "choices": [
                        {
                            "index": 0,
                            "text": " is",
                            "exit_depths": [2, 3],
                            "finish_reason": "length",
                        }
                    ]
                }
            ),
            json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
            "[DONE]",
        ]
        return httpx2.Response(200, content=sse(*events))

    request = BenchRequest(0, 3, prompt=[1, 2, 3], prompt_len=3)
    result = RequestResult(index=0)

    async def main():
        async with wire_client(handler) as client:
            await send_request(client, ENDPOINT, request, OPTIONS, result, 0.0)

    asyncio.run(main())
    [(path, body, headers)] = seen
    assert path == "/v1/completions" and headers["authorization"] == "Bearer k"
    assert body == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
        "exit_threshold": 0.5,
        "max_loops": 4,
    }
    assert result.success and result.chunk_tokens == [1, 2] and result.exit_depths == [4, 2, 3]
    assert (result.prompt_tokens, result.output_tokens, result.finish_reason) == (3, 3, "length")


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ("status", "http_429"),
        ("error_event", "stream_error"),
        ("refused", "connection_error"),
        ("timeout", "timeout"),
    ],
)
def test_the_wire_client_turns_failures_into_error_kinds(answer, kind):
    import httpx2

    def handler(request):
        if answer == "status":
            body = {"error": {"message": "too many", "type": "overloaded", "code": 429}}
            return httpx2.Response(429, json=body)
        if answer == "error_event":
            event = json.dumps({"error": {"message": "engine died", "code": 500}})
            return httpx2.Response(200, content=sse(event, "[DONE]"))
        if answer == "refused":
            raise httpx2.ConnectError("refused", request=request)
        raise httpx2.ReadTimeout("slow", request=request)

    result = RequestResult(index=0)

    async def main():
        async with wire_client(handler) as client:
            await send_request(client, ENDPOINT, BenchRequest(0, 2, prompt=[1]), OPTIONS, result, 0)

    asyncio.run(main())
    assert not result.success and result.error_kind == kind


def test_the_wire_client_lists_the_models_cards():
    import httpx2

    cards = [{"id": "rlt", "object": "model", "vocab_size": 49152}]

    async def main():
        async with wire_client(lambda r: httpx2.Response(200, json={"data": cards})) as client:
            return await client.list_models()

    assert asyncio.run(main()) == cards


def test_a_run_in_which_no_request_succeeds_exits_1_naming_the_errors(
    monkeypatch, tmp_path, capsys
):
    """The test request succeeds, then the server fails every request of the run (503): the
    run's summary is still printed and saved, and the command exits 1 naming the errors."""
    import httpx2
    import rlt.bench.session as session

    paths = []

    def handler(request):
        paths.append(request.url.path)
        if len(paths) == 1:  # the test request
            chunk = {"choices": [{"index": 0, "text": "It", "finish_reason": "length"}]}
            return httpx2.Response(200, content=sse(json.dumps(chunk), "[DONE]"))
        error = {"message": "the engine is unavailable", "type": "engine_unavailable"}
        return httpx2.Response(503, json={"error": {**error, "code": 503}})

    monkeypatch.setattr(session, "make_client", lambda *args, **kwargs: wire_client(handler))
    code = main(
        ["bench", "serve", "--base-url", "http://bench.test", "--model", "m", "--disable-tqdm"]
        + "--random-vocab-size 100 --num-prompts 3 --random-input-len 2".split()
        + ["--random-output-len", "1"]
        + ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"]
    )
    assert code == EXIT_FAILURE
    assert paths == ["/v1/completions"] * 4
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "no request of the run at rate inf succeeded" in captured.err
    assert "http_503" in captured.err and "the engine is unavailable" in captured.err
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"]) == (0, 3)


def test_a_server_that_does_not_answer_exits_1_saying_so(capsys):
    from serving_harness import free_port

    code = main(["bench", "serve", "--port", str(free_port()), "--disable-tqdm"])
    assert code == EXIT_FAILURE
    error = capsys.readouterr().err
    assert "cannot list models at http://127.0.0.1:" in error and "is the server up?" in error
    with pytest.raises(SystemExit) as refused:  # a port outside 0..65535: a bad flag, exit 2
        main(["bench", "serve", "--port", "65536"])
    assert refused.value.code == 2
