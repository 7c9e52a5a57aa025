"""`rlt bench serve` takes `vllm bench serve`'s options (issue 41) and writes its result keys.

Without a server: `--backend` with and without `--endpoint`, `--random-prefix-len`,
`--percentile-metrics`, the peaks, the ShareGPT sampler (vLLM's order for a seed, its length
filter, reuse) with the bundled model's tokenizer, and the refusals. Against a served tiny
model (serving_harness.py, CPU): each option in a run, and the saved JSON holds every key
vLLM's does.
"""

from __future__ import annotations

import json
import random

import pytest
from rlt.bench import Endpoint, RequestResult, random_requests, summarize
from rlt.bench.metrics import parse_percentile_metrics, peaks
from rlt.bench.sharegpt import sharegpt_requests
from rlt.bench.tokenizer import count_tokens, load_bench_tokenizer
from rlt.cli import main
from rlt.engine.assembly import DEFAULT_MODEL_DIR
from rlt_contracts import ConfigurationError
from rlt_serve.exit_codes import EXIT_USAGE

# What `vllm bench serve --save-result --save-detailed` writes for a generation run
# (vllm/benchmarks/serve.py), besides the latency keys of its --percentile-metrics.
VLLM_KEYS = (
    "date endpoint_type backend label model_id tokenizer_id num_prompts request_rate "
    "burstiness max_concurrency duration completed failed total_input_tokens "
    "total_output_tokens request_throughput request_goodput output_throughput "
    "total_token_throughput input_lens output_lens ttfts itls generated_texts errors "
    "max_output_tokens_per_s max_concurrent_requests"
).split()


def latency_keys(metric: str, percentiles) -> list[str]:
    keys = [f"{stat}_{metric}_ms" for stat in ("mean", "median", "std")]
    return keys + [f"p{q:g}_{metric}_ms" for q in percentiles]


# -- backend and endpoint ------------------------------------------------------------------------


def test_backend_picks_the_endpoint_and_must_agree_with_a_given_one():
    base = "http://127.0.0.1:8000"
    assert Endpoint.resolve(base, None, "openai-chat").path == "/v1/chat/completions"
    assert Endpoint.resolve(base, None, "openai").path == "/v1/completions"
    assert Endpoint.resolve(base, None, "vllm").path == "/v1/completions"
    assert Endpoint.resolve(base, None, None).path == "/v1/completions"  # as before
    assert Endpoint.resolve(base, "/v1/chat/completions", None).chat  # the path decides
    custom = Endpoint.resolve(base, "/proxy/v1/chat/completions", "openai-chat")
    assert custom.chat and custom.api_base == f"{base}/proxy/v1"
    with pytest.raises(ConfigurationError, match="--backend openai-chat sends chat"):
        Endpoint.resolve(base, "/v1/completions", "openai-chat")
    with pytest.raises(ConfigurationError, match="backend"):
        Endpoint.resolve(base, "/v1/chat/completions", "openai")
    with pytest.raises(ConfigurationError, match="backend"):
        Endpoint.resolve(base, None, "tgi")


# -- random prefix -------------------------------------------------------------------------------


def test_random_prefix_is_shared_drawn_once_and_leaves_prefixless_workloads_unchanged():
    plain = random_requests(6, input_len=5, output_len=3, chat=False, range_ratio=0.5, seed=4)
    same = random_requests(
        6, input_len=5, output_len=3, chat=False, range_ratio=0.5, seed=4, prefix_len=0
    )
    assert same == plain  # a seed's earlier workload is kept
    prefixed = random_requests(
        6, input_len=5, output_len=3, chat=False, range_ratio=0.5, seed=4, prefix_len=7
    )
    prefix = prefixed[0].prompt[:7]
    for before, after in zip(plain, prefixed, strict=True):
        assert after.prompt[:7] == prefix and after.prompt_len == 7 + before.prompt_len
        assert after.output_len == before.output_len  # the lengths are drawn first
    chat = random_requests(3, input_len=4, output_len=2, chat=True, seed=1, prefix_len=3)
    words = [r.messages[0]["content"].split() for r in chat]
    assert all(w[:3] == words[0][:3] and len(w) == 7 for w in words)
    with pytest.raises(ConfigurationError, match="random_prefix_len"):
        random_requests(1, input_len=1, output_len=1, chat=False, prefix_len=-1)


# -- percentiles, goodput and peaks --------------------------------------------------------------


def finished(index, start, ttft, itls, chunks):
    return RequestResult(
        index=index,
        start=start,
        success=True,
        ttft=ttft,
        itls=list(itls),
        chunk_tokens=list(chunks),
        latency=ttft + sum(itls),
        prompt_tokens=4,
        output_tokens=sum(chunks),
        tokens_seen=sum(chunks),
        usage_reported=True,
        text_chunks=["a"] * len(chunks),
    )


def test_percentile_metrics_select_the_percentile_keys_and_peaks_are_counted_per_second():
    assert parse_percentile_metrics("ttft, e2el,ttft") == ("ttft", "e2el")
    for bad in ("", "ttft,latency", "p99"):
        with pytest.raises(ConfigurationError, match="percentile_metrics"):
            parse_percentile_metrics(bad)
    results = [
        finished(0, 0.0, 0.5, [0.3, 0.3], [1, 2, 1]),  # tokens at 0.5, 0.8, 1.1 s
        finished(1, 0.9, 0.2, [0.1], [1, 3]),  # at 1.1 and 1.2 s; in flight in seconds 0-1
        finished(2, 2.5, 0.1, [], [1]),  # at 2.6 s
    ]
    assert peaks(results) == (5.0, 2)  # second 1: 1 + 1 + 3 tokens; requests 0 and 1
    s = summarize(results, 3.0, percentiles=(50, 99.9), percentile_metrics=("ttft",))
    assert s["p50_ttft_ms"] == pytest.approx(200.0) and "p99.9_ttft_ms" in s
    assert not any(k.startswith("p") and k.endswith(("_tpot_ms", "_itl_ms", "_e2el_ms")) for k in s)
    assert s["mean_e2el_ms"] is not None and s["median_tpot_ms"] is not None
    assert s["request_goodput"] is None  # vLLM's key, null without --goodput
    assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == (5.0, 2)
    assert s["generated_texts"] == ["aaa", "aa", "a"]


# -- ShareGPT ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_bench_tokenizer(str(DEFAULT_MODEL_DIR))


def conversation(prompt: str, reply: str | None = None, *, cid: str) -> dict:
    turns = [{"from": "human", "value": prompt}]
    if reply is not None:
        turns.append({"from": "gpt", "value": reply})
    return {"id": cid, "conversations": turns}


def write_sharegpt(path, entries) -> str:
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)


LONG_REPLY = "It was the best of times, it was the worst of times, it was the age of wisdom."


def test_sharegpt_sampling_follows_vllms_order_filter_and_lengths(tmp_path, tokenizer):
    entries = [
        conversation("Tell me about the river and the town beside it.", LONG_REPLY, cid="a"),
        conversation("A question with no answer in the file.", cid="one-turn"),
        conversation("Please say something very short to me now.", "Yes.", cid="short"),
        conversation("Hi", LONG_REPLY, cid="tiny-prompt"),
        conversation("What do you know of Emma and her dear friends?", LONG_REPLY, cid="b"),
    ]
    path = write_sharegpt(tmp_path / "sharegpt.json", entries)
    requests = sharegpt_requests(path, 5, chat=False, tokenizer=tokenizer, seed=3)
    # vLLM's order: the two-turn entries shuffled by random.seed(seed); random.shuffle(...)
    order = [e for e in entries if len(e["conversations"]) >= 2]
    random.Random(3).shuffle(order)
    qualifying = [e["conversations"][0]["value"] for e in order if e["id"] in ("a", "b")]
    assert [r.prompt for r in requests] == (qualifying * 3)[:5]  # reused in order
    assert [r.index for r in requests] == list(range(5))
    reply_len = len(tokenizer(LONG_REPLY).input_ids)
    for r in requests:
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids) and r.output_len == reply_len
    # a fixed output length skips the reply's check ("Yes." qualifies) and sets max_tokens
    fixed = sharegpt_requests(path, 3, chat=True, tokenizer=tokenizer, output_len=9, seed=3)
    texts = {r.messages[0]["content"] for r in fixed}
    assert "Please say something very short to me now." in texts
    assert all(r.output_len == 9 and r.messages[0]["role"] == "user" for r in fixed)


def test_sharegpt_refuses_what_it_cannot_use(tmp_path, tokenizer):
    def refused(entries, match, **kwargs):
        path = tmp_path / "bad.json"
        path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
        with pytest.raises(ConfigurationError, match=match):
            sharegpt_requests(path, 2, chat=False, tokenizer=tokenizer, **kwargs)

    refused("[{", "not JSON")
    refused({"conversations": []}, "JSON list")
    refused([conversation("Hi", cid="x")], "no conversation qualifies")
    refused([{"conversations": [{"from": "human"}, {"value": "x"}]}], 'string "value"')
    refused(
        [conversation("Tell me more about it.", LONG_REPLY, cid="x")],
        "sharegpt_output_len",
        output_len=0,
    )
    with pytest.raises(ConfigurationError, match="cannot read"):
        sharegpt_requests(tmp_path / "missing.json", 1, chat=False, tokenizer=tokenizer)


def test_a_tokenizer_that_does_not_load_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigurationError, match="tokenizer.*cannot load a tokenizer"):
        load_bench_tokenizer(str(tmp_path))  # a directory without tokenizer files
    with pytest.raises(ConfigurationError, match="no-such-org/no-such-model"):
        load_bench_tokenizer("no-such-org/no-such-model")  # not in the cache, offline


def test_sharegpt_needs_a_tokenizer_and_bad_counts_are_usage_errors(tmp_path, capsys):
    path = write_sharegpt(tmp_path / "s.json", [conversation("Hi there", LONG_REPLY, cid="a")])
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--disable-tqdm"]
    assert main([*base, "--dataset-name", "sharegpt", "--dataset-path", path]) == EXIT_USAGE
    assert "pass --tokenizer" in capsys.readouterr().err
    assert main([*base, "--dataset-name", "sharegpt"]) == EXIT_USAGE
    assert "needs --dataset-path" in capsys.readouterr().err
    assert main([*base, "--num-warmups", "-1"]) == EXIT_USAGE
    assert main([*base, "--percentile-metrics", "ttft,p99"]) == EXIT_USAGE
    assert main([*base, "--backend", "openai-chat", "--endpoint", "/v1/completions"]) == EXIT_USAGE


# -- against a served tiny model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server():
    from serving_harness import run_server

    with run_server(DEFAULT_MODEL_DIR) as running:
        yield running


def generated_tokens(server) -> int:
    return server.client.stats().generation_tokens


def run(server, tmp_path, *flags) -> dict:
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--save-result"]
        + ["--result-dir", str(tmp_path), "--result-filename", "run.json", *flags]
    )
    assert code == 0
    return json.loads((tmp_path / "run.json").read_text())


def test_live_sharegpt_chat_with_warmups_and_chosen_percentiles(live_server, tmp_path, tokenizer):
    prompts = [
        "Tell me about the river and the town beside it.",
        "What do you know of Emma and her dear friends?",
        "Where did the old road lead when the war was over?",
    ]
    entries = [conversation(p, LONG_REPLY, cid=str(i)) for i, p in enumerate(prompts)]
    path = write_sharegpt(tmp_path / "sharegpt.json", entries)
    before = generated_tokens(live_server)
    result = run(
        live_server,
        tmp_path,
        *"--backend openai-chat --dataset-name sharegpt --num-prompts 4".split(),
        *f"--dataset-path {path} --tokenizer {DEFAULT_MODEL_DIR} --sharegpt-output-len 6".split(),
        *"--num-warmups 3 --max-concurrency 2 --ignore-eos".split(),
        *"--percentile-metrics ttft,e2el --metric-percentiles 25,99.5".split(),
    )
    for key in VLLM_KEYS + latency_keys("ttft", (25, 99.5)) + latency_keys("e2el", (25, 99.5)):
        assert key in result, key
    assert not any(f"p{q}_{m}_ms" in result for q in (25, 99.5) for m in ("tpot", "itl"))
    assert result["endpoint"] == "/v1/chat/completions"  # implied by the backend
    assert result["backend"] == result["endpoint_type"] == "openai-chat"
    assert result["tokenizer_id"] == str(DEFAULT_MODEL_DIR) and result["num_warmups"] == 3
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["output_lens"] == [6] * 4 and result["total_output_tokens"] == 24
    assert result["request_goodput"] is None
    # requests active at any time in the busiest one-second bucket (vLLM's coarse count)
    assert 1 <= result["max_concurrent_requests"] <= 4 and result["max_output_tokens_per_s"] > 0
    assert all(isinstance(t, str) and t for t in result["generated_texts"])
    # the test request, 3 warm-ups (copies of request 0) and the run: 6 tokens each
    assert generated_tokens(live_server) - before == 6 * (1 + 3 + 4)


def test_live_completions_with_a_random_prefix_and_the_vllm_backend(live_server, tmp_path):
    result = run(
        live_server,
        tmp_path,
        *"--backend vllm --num-prompts 5 --random-input-len 6 --random-prefix-len 10".split(),
        *"--random-output-len 3 --ignore-eos --seed 7".split(),
    )
    for key in VLLM_KEYS + [
        k for m in ("ttft", "tpot", "itl", "e2el") for k in latency_keys(m, (50, 90, 99))
    ]:
        assert key in result, key
    assert result["backend"] == "vllm" and result["endpoint"] == "/v1/completions"
    assert result["input_lens"] == [16] * 5 and result["random_prefix_len"] == 10
    assert result["completed"] == 5 and result["total_output_tokens"] == 15


def test_live_replies_without_usage_are_counted_with_the_tokenizer(
    live_server, tmp_path, tokenizer
):
    """A server that sends no usage (here: rlt asked not to) has its replies' tokens counted
    with --tokenizer, as vLLM counts them, not one per chunk."""
    result = run(
        live_server,
        tmp_path,
        *"--endpoint /v1/chat/completions --num-prompts 3 --random-input-len 5".split(),
        *f"--random-output-len 12 --ignore-eos --tokenizer {DEFAULT_MODEL_DIR}".split(),
        "--extra-body",
        '{"stream_options": {"include_usage": false}}',
    )
    assert result["completed"] == 3
    counted = [count_tokens(tokenizer, text) for text in result["generated_texts"]]
    assert result["output_lens"] == counted and result["total_output_tokens"] == sum(counted)
