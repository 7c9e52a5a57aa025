"""`/metrics` after real traffic agrees exactly with what the clients observed.

A live server (uvicorn, tiny model, a KV pool small enough to preempt) serves a mix of
completions and chat completions, streaming and not, one and several prompts, finishing by
length and by a stop token, through the official `openai` client, while another task keeps
scraping. Afterwards every per-request histogram must count exactly the engine requests the
clients saw, the token histograms exactly their tokens, and the exit-depth histogram exactly
the distribution of the exit depths the clients received. The engine counters must agree with
the clients and with `EngineClient.stats()`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

import httpx2
import openai
import pytest
from serving_harness import metric_samples, run_server

LOOPS = dict(exit_threshold=0.8, min_loops=1, ignore_eos=True)  # adaptive exit: depths vary
DEPTH = 4  # l2_t4: 4 loops
PER_REQUEST = (
    "rlt:time_to_first_token_seconds",
    "rlt:e2e_request_latency_seconds",
    "rlt:request_queue_time_seconds",
    "rlt:request_prefill_time_seconds",
    "rlt:request_decode_time_seconds",
    "rlt:request_inference_time_seconds",
    "rlt:request_prompt_tokens",
    "rlt:request_generation_tokens",
)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    engine = dict(max_num_seqs=4, num_kv_blocks=40, incremental_kv=True, enable_preemption=True)
    with run_server(checkpoint, served_model_name="tiny", engine=engine) as running:
        yield running


@dataclass
class Seen:
    """What the clients observed, per engine request (one per prompt / choice)."""

    prompt_tokens: list[int] = field(default_factory=list)
    exit_depths: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    http: Counter = field(default_factory=Counter)  # (endpoint, outcome) -> requests

    def add(self, prompt_tokens: int, depths: list[int], reason: str) -> None:
        self.prompt_tokens.append(prompt_tokens)
        self.exit_depths.append(depths)
        self.finish_reasons.append(reason)


def scrape(text: str) -> dict:
    """{(sample name, labels without model_name): value}; every `rlt:` sample has a model_name."""
    values = {}
    for name, labels, value in metric_samples(text):
        if name.startswith("rlt:"):
            assert labels.pop("model_name")
        values[(name, tuple(sorted(labels.items())))] = value
    return values


async def traffic(client: openai.AsyncOpenAI, seen: Seen) -> None:
    async def streamed_completion(prompt: list[int], max_tokens: int, **extra) -> None:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={**LOOPS, **extra},
        )
        depths, reason, usage = [], None, None
        async for chunk in stream:
            for choice in chunk.choices:
                depths += choice.model_extra["exit_depths"]
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        assert usage.completion_tokens == len(depths)
        seen.add(usage.prompt_tokens, depths, reason)
        seen.http["completions", reason] += 1

    async def batch_completion(prompts: list[list[int]], max_tokens: int) -> None:
        completion = await client.completions.create(
            model="tiny", prompt=prompts, max_tokens=max_tokens, temperature=0, extra_body=LOOPS
        )
        for choice, prompt in zip(completion.choices, prompts, strict=True):
            seen.add(len(prompt), choice.model_extra["exit_depths"], choice.finish_reason)
        total = sum(len(c.model_extra["exit_depths"]) for c in completion.choices)
        assert completion.usage.completion_tokens == total
        seen.http["completions", "length"] += 1

    async def chat(max_tokens: int, stream: bool) -> None:
        messages = [{"role": "user", "content": "Tell me about loops."}]
        common = dict(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
        if stream:
            chunks = await client.chat.completions.create(
                **common, stream=True, stream_options={"include_usage": True}, extra_body=LOOPS
            )
            depths, reason, usage = [], None, None
            async for chunk in chunks:
                for choice in chunk.choices:
                    depths += choice.model_extra["exit_depths"]
                    reason = choice.finish_reason or reason
                usage = chunk.usage or usage
        else:
            response = await client.chat.completions.create(**common, extra_body=LOOPS)
            [choice] = response.choices
            depths, reason, usage = choice.model_extra["exit_depths"], choice.finish_reason, None
            usage = response.usage
        assert usage.completion_tokens == len(depths)
        seen.add(usage.prompt_tokens, depths, reason)
        seen.http["chat_completions", reason] += 1

    # A greedy request decides a stop token that a second, identical request then hits.
    probe = await client.completions.create(
        model="tiny",
        prompt=[7, 8, 9],
        max_tokens=6,
        temperature=0,
        extra_body={**LOOPS, "return_token_ids": True},
    )
    [choice] = probe.choices
    seen.add(3, choice.model_extra["exit_depths"], choice.finish_reason)
    seen.http["completions", "length"] += 1
    stop_at = choice.model_extra["token_ids"][3]

    await asyncio.gather(
        *(
            streamed_completion([5 + i, 17, 200 - i, 3, 99][: 2 + i % 4], 12 + 5 * i)
            for i in range(6)
        ),
        streamed_completion([7, 8, 9], 6, stop_token_ids=[stop_at]),
        batch_completion([[1, 2, 3, 4], [9, 8, 7], [11] * 9], 10),
        chat(9, stream=True),
        chat(7, stream=False),
    )


def test_metrics_agree_with_what_the_clients_saw(server):
    seen = Seen()
    samples: list[dict] = []

    async def main() -> None:
        async with httpx2.AsyncClient(base_url=server.base_url, trust_env=False) as http:
            before = scrape((await http.get("/metrics")).text)
            client = openai.AsyncOpenAI(
                base_url=f"{server.base_url}/v1",
                api_key="unused",
                max_retries=0,
                http_client=httpx2.AsyncClient(trust_env=False, timeout=30),
            )
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    samples.append(scrape((await http.get("/metrics")).text))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            try:
                await traffic(client, seen)
            finally:
                done.set()
                await watcher
            samples.insert(0, before)

    asyncio.run(main())
    stats = server.wait_idle()
    with server.http() as http:
        after = scrape(http.get("/metrics").text)
    before = samples[0]

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = len(seen.exit_depths)
    tokens = [len(d) for d in seen.exit_depths]
    decoded = [d for depths in seen.exit_depths for d in depths[1:]]
    assert requests == 13 and all(tokens) and min(tokens) >= 2

    # per-request histograms: one observation per engine request the clients saw
    for name in PER_REQUEST:
        assert moved(f"{name}_count") == requests, name
        assert moved(f"{name}_bucket", le="+Inf") == requests, name
    for name in PER_REQUEST[:-2]:
        assert moved(f"{name}_sum") > 0, name
    assert moved("rlt:request_prompt_tokens_sum") == sum(seen.prompt_tokens)
    assert moved("rlt:request_generation_tokens_sum") == sum(tokens)
    prefill = moved("rlt:request_prefill_time_seconds_sum")
    decode = moved("rlt:request_decode_time_seconds_sum")
    inference = moved("rlt:request_inference_time_seconds_sum")
    assert math.isclose(inference, prefill + decode, rel_tol=1e-9)
    assert moved("rlt:e2e_request_latency_seconds_sum") > moved(
        "rlt:time_to_first_token_seconds_sum"
    )
    reasons = Counter(seen.finish_reasons)
    assert reasons["stop"] == 1 and reasons["length"] == requests - 1
    for reason in ("stop", "length", "abort"):
        assert moved("rlt:request_success_total", finished_reason=reason) == reasons[reason]
    for (endpoint, outcome), count in seen.http.items():
        assert moved("rlt:http_requests_total", endpoint=endpoint, outcome=outcome) == count

    # per-token histograms: every token after the first of each request
    assert moved("rlt:inter_token_latency_seconds_count") == sum(tokens) - requests
    assert moved("rlt:loops_per_token_count") == len(decoded)
    assert moved("rlt:loops_per_token_sum") == sum(decoded)
    for k in range(1, DEPTH + 1):  # the exit-depth distribution, bucket by bucket
        assert moved("rlt:loops_per_token_bucket", le=f"{k}.0") == sum(d <= k for d in decoded)
    assert len(set(decoded)) > 1  # adaptive exit did vary the depth

    # engine counters agree with the clients and with the engine's own statistics
    assert moved("rlt:generation_tokens_total") == sum(tokens)
    assert moved("rlt:decode_loops_total") == sum(decoded)
    assert 0 < moved("rlt:prompt_tokens_total") <= sum(seen.prompt_tokens)
    assert moved("rlt:engine_steps_total") > 0
    assert after[("rlt:num_preemptions_total", ())] == stats.preemptions
    assert after[("rlt:num_resumptions_total", ())] == stats.resumptions
    assert after[("rlt:prefix_cache_queries_total", ())] == stats.prefix_cache_queried_tokens
    assert after[("rlt:prefix_cache_hits_total", ())] == stats.prefix_cache_hit_tokens
    assert stats.preemptions > 0  # the small pool did preempt

    # gauges: busy while the traffic ran, empty afterwards
    assert max(s[("rlt:num_requests_running", ())] for s in samples) >= 1
    assert max(s[("rlt:kv_cache_usage_perc", ())] for s in samples) > 0
    assert all(0 <= s[("rlt:kv_cache_usage_perc", ())] <= 1 for s in samples)
    for gauge in ("rlt:num_requests_running", "rlt:num_requests_waiting"):
        assert after[(gauge, ())] == 0
    assert after[("rlt:kv_cache_usage_perc", ())] == 0
    assert after[("rlt:kv_cache_blocks_total", ())] == 40
    assert after[("rlt:engine_up", ())] == 1
