"""`AsyncEngine`: the EngineClient over an LLMEngine whose core runs on its own thread (no HTTP
here).

Covered: streamed deltas add up to LLM.generate's outputs (tokens, exit depths, text, logprobs)
for concurrent requests, and a FINAL reader (`stream_final`) gets the same as one delta; stop
strings never leak into streamed text (nor a FINAL reader's); cancel mid-stream frees KV; cancel
of unknown/finished ids is a no-op; request-id reuse after abort does not mix results; submit
errors (invalid, capacity, overload, duplicate id) leave the engine serving; engine-thread
failure ends streams with EngineDeadError; shutdown aborts in-flight requests; submit_many
queues a batch all or none.
"""

from __future__ import annotations

import asyncio

import pytest
from rlt import LLM, SamplingParams
from rlt.engine import EngineConfig, LLMEngine
from rlt.serving import AsyncEngine
from rlt_contracts import (
    CapacityError,
    EngineClient,
    EngineDeadError,
    EngineRequest,
    InvalidRequestError,
    OverloadedError,
)
from serving_harness import ENGINE_DEFAULTS, assert_engine_clean

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16], [7]]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(checkpoint, **ENGINE_DEFAULTS)


def make_engine(checkpoint, **options) -> AsyncEngine:
    return AsyncEngine(
        LLMEngine(EngineConfig.from_options(model=checkpoint, **{**ENGINE_DEFAULTS, **options}))
    )


async def collect(client: EngineClient, request_id: str, *, final: bool = False) -> dict:
    """`final`: read as a FINAL consumer (`stream_final`: one delta, once it ended)."""
    tokens, depths, text, logprobs, deltas = [], [], [], [], []
    reader = client.stream_final if final else client.stream
    async for delta in reader(request_id):
        deltas.append(delta)
        tokens += delta.token_ids
        depths += delta.exit_depths
        text.append(delta.text)
        logprobs += delta.logprobs or ()
    return dict(tokens=tokens, depths=depths, text="".join(text), logprobs=logprobs, deltas=deltas)


def test_async_engine_implements_the_protocol(checkpoint):
    client = make_engine(checkpoint)
    try:
        assert isinstance(client, EngineClient)
        assert client.model_info().vocab_size == 320
        assert client.stats().kv_blocks_used == 0
    finally:
        client.close()


def test_concurrent_streams_add_up_to_generate(checkpoint, reference):
    params = SamplingParams(max_tokens=9, exit_threshold=0.8, ignore_eos=True, logprobs=2)
    expected = reference.generate(PROMPTS, params)
    client = make_engine(checkpoint)

    async def main():
        for i, prompt in enumerate(PROMPTS):
            await client.submit(EngineRequest(f"r{i}", tuple(prompt), params))
            await client.submit(EngineRequest(f"f{i}", tuple(prompt), params))
        streams = [collect(client, f"r{i}") for i in range(len(PROMPTS))]
        finals = [collect(client, f"f{i}", final=True) for i in range(len(PROMPTS))]
        return await asyncio.gather(*streams, *finals)

    try:
        results = asyncio.run(main())
        streamed, finals = results[: len(PROMPTS)], results[len(PROMPTS) :]
        for got, streamed_one in zip(finals, streamed, strict=True):
            # FINAL: one delta holding what the deltas of a stream add up to
            [only] = got["deltas"]
            assert only.finished and only.timings is not None
            for key in ("tokens", "depths", "text"):
                assert got[key] == streamed_one[key]
            # (two rows of one batch may round their fp32 sums differently)
            assert got["logprobs"] == pytest.approx(streamed_one["logprobs"], abs=1e-5)
            assert len(streamed_one["deltas"]) > 1
        for got, want in zip(streamed + finals, expected + expected, strict=True):
            assert got["tokens"] == want.token_ids
            assert got["depths"] == want.exit_depths
            assert got["text"] == want.text
            assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
            final = got["deltas"][-1]
            assert final.finished and final.finish_reason == "length"
            assert all(not d.finished for d in got["deltas"][:-1])
            assert final.num_prompt_tokens > 0
        assert client.stats().kv_blocks_used == 0
        assert client.stats().finished_requests == 2 * len(PROMPTS)
    finally:
        client.close()
    assert_engine_clean(client._engine)


def test_streamed_text_never_contains_a_stop_string(checkpoint, reference):
    # A 3-character stop string taken from the middle of the real output, so it matches
    # mid-generation, after the stream has already sent text (the hold-back is 2 characters).
    prompt = "Children ran along the bank"
    free = reference.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    start = next(
        i
        for i in range(8, len(free.text) - 3)
        if "\ufffd" not in free.text[i : i + 3] and free.text.find(free.text[i : i + 3]) == i
    )
    stop = free.text[start : start + 3]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    want = reference.generate(prompt, params)[0]
    assert want.finish_reason == "stop" and stop not in want.text
    client = make_engine(checkpoint)

    async def main():
        ids = reference.tokenizer(prompt, add_special_tokens=False).input_ids
        await client.submit(EngineRequest("s", tuple(ids), params))
        await client.submit(EngineRequest("f", tuple(ids), params))
        return await asyncio.gather(collect(client, "s"), collect(client, "f", final=True))

    try:
        got, final = asyncio.run(main())
    finally:
        client.close()
    [only] = final["deltas"]
    assert (only.text, list(only.token_ids), only.finish_reason) == (
        want.text,
        want.token_ids,
        "stop",
    )
    assert got["text"] == want.text
    assert got["tokens"] == want.token_ids
    assert got["deltas"][-1].finish_reason == "stop"
    assert any(d.text for d in got["deltas"][:-1]), "no text before the stop: nothing was held back"


def test_cancel_mid_stream_frees_kv_and_unknown_cancel_is_a_noop(checkpoint):
    # One tick per step and the longest request the context allows (3 + 500 - 1 <= 512): the
    # cancel races with the engine thread, which must not finish the request first.
    client = make_engine(checkpoint, decode_ticks_per_step=1)
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        await client.cancel("never-submitted")  # no-op
        await client.submit(EngineRequest("c", (5, 6, 7), params))
        deltas = []
        async for delta in client.stream("c"):
            deltas.append(delta)
            if sum(len(d.token_ids) for d in deltas) >= 3 and not delta.finished:
                assert client.stats().kv_blocks_used > 0
                await client.cancel("c")
        await client.cancel("c")  # finished: no-op
        return deltas

    try:
        deltas = asyncio.run(main())
        assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
        assert sum(len(d.token_ids) for d in deltas) < 500
        stats = client.stats()
        assert stats.kv_blocks_used == 0 and stats.aborted_requests == 1
        assert stats.running_requests == 0
    finally:
        client.close()


def test_a_reader_that_leaves_early_leaves_nothing_behind(checkpoint):
    """A client that stops reading (and cancels, as the HTTP app does on a disconnect): once
    the core's final delta arrives, the front end holds no state of the request."""
    client = make_engine(checkpoint, decode_ticks_per_step=1)
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        await client.submit(EngineRequest("gone", (5, 6, 7), params))
        stream = client.stream("gone")
        await anext(stream)
        await stream.aclose()  # the reader leaves
        await client.cancel("gone")
        deadline = asyncio.get_running_loop().time() + 10
        while client._streams or client._processor.states:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert client.stats().kv_blocks_used == 0
    finally:
        client.close()


def test_request_id_reuse_after_abort_never_mixes_results(checkpoint, reference):
    params = SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=0.8)
    want = reference.generate([[9, 8, 7]], params)[0]
    client = make_engine(checkpoint)

    async def main():
        await client.submit(
            EngineRequest("same", (1, 2, 3, 4), SamplingParams(max_tokens=300, ignore_eos=True))
        )
        first = client.stream("same")
        first_delta = await anext(first)  # the first request is running
        await client.cancel("same")
        rest = [d async for d in first]
        # Reuse the id at once; a stale cancel aimed at the old request must not hit the new one.
        await client.submit(EngineRequest("same", (9, 8, 7), params))
        second = await collect(client, "same")
        return [first_delta, *rest], second

    try:
        first, second = asyncio.run(main())
    finally:
        client.close()
    assert first[-1].finish_reason == "abort"
    assert second["tokens"] == want.token_ids and second["depths"] == want.exit_depths
    assert second["deltas"][-1].finish_reason == "length"


def test_submit_errors_leave_the_engine_serving(checkpoint):
    client = make_engine(checkpoint, max_num_seqs=1, max_waiting_requests=1, num_kv_blocks=64)
    long = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        with pytest.raises(InvalidRequestError) as err:
            await client.submit(EngineRequest("bad", (1, 999), SamplingParams()))
        assert err.value.field == "prompt"
        with pytest.raises(CapacityError):  # 64 blocks of 4 positions x 4 planes hold 64 tokens
            await client.submit(EngineRequest("big", (1, 2), SamplingParams(max_tokens=100)))
        with pytest.raises(InvalidRequestError) as err:
            await client.submit(EngineRequest("loops", (1,), SamplingParams(max_loops=9)))
        assert err.value.field == "max_loops"
        await client.submit(
            EngineRequest("a", (1, 2), SamplingParams(max_tokens=50, ignore_eos=True))
        )
        stream_a = client.stream("a")
        await anext(stream_a)  # "a" is running now; the next request waits
        with pytest.raises(InvalidRequestError) as err:
            await client.submit(EngineRequest("a", (3,), SamplingParams()))
        assert err.value.field == "request_id"
        await client.submit(EngineRequest("b", (3, 4), long))
        with pytest.raises(OverloadedError):
            await client.submit(EngineRequest("c", (5, 6), long))
        await client.cancel("b")
        await client.cancel("a")
        async for _ in client.stream("b"):
            pass
        async for _ in stream_a:
            pass
        await client.submit(EngineRequest("ok", (5, 6), SamplingParams(max_tokens=3)))
        return await collect(client, "ok")

    try:
        result = asyncio.run(main())
        assert len(result["tokens"]) == 3
        assert client.stats().kv_blocks_used == 0
    finally:
        client.close()
    assert_engine_clean(client._engine)


def test_engine_thread_failure_ends_streams_with_engine_dead_error(checkpoint):
    engine = LLMEngine(EngineConfig.from_options(model=checkpoint, **ENGINE_DEFAULTS))
    real_step = engine.core.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.core.step = failing_step
    client = AsyncEngine(engine)

    async def main():
        await client.submit(
            EngineRequest("x", (1, 2, 3), SamplingParams(max_tokens=50, ignore_eos=True))
        )
        with pytest.raises(EngineDeadError):
            async for _ in client.stream("x"):
                pass
        with pytest.raises(EngineDeadError):
            await client.submit(EngineRequest("y", (1,), SamplingParams()))

    try:
        asyncio.run(main())
        assert isinstance(client.dead, EngineDeadError)
        assert "simulated device failure" in str(client.dead)
    finally:
        client.close()


def test_shutdown_aborts_in_flight_requests(checkpoint):
    client = make_engine(checkpoint)

    async def main():
        await client.submit(
            EngineRequest("long", (1, 2, 3), SamplingParams(max_tokens=400, ignore_eos=True))
        )
        stream = client.stream("long")
        await anext(stream)
        await client.shutdown()
        rest = [d async for d in stream]
        with pytest.raises(EngineDeadError):
            await client.submit(EngineRequest("late", (1,), SamplingParams()))
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert client.stopped
    assert_engine_clean(client._engine)


def test_submit_many_queues_all_or_none(checkpoint):
    client = make_engine(checkpoint, max_num_seqs=2, max_waiting_requests=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main():
        # one bad request: nothing of the batch is queued
        bad = [EngineRequest("x0", (5, 6), params), EngineRequest("x1", (5, 999), params)]
        with pytest.raises(InvalidRequestError) as err:
            await client.submit_many(bad)
        assert err.value.field == "prompt"
        # 2 runner slots + 1 waiting: a batch of 4 can never be queued
        many = [EngineRequest(f"m{i}", (5, 6), params) for i in range(4)]
        with pytest.raises(InvalidRequestError):
            await client.submit_many(many)
        stats = client.stats()
        assert (stats.waiting_requests, stats.running_requests, stats.aborted_requests) == (0, 0, 0)
        await client.submit_many(many[:3])
        return [await collect(client, f"m{i}") for i in range(3)]

    try:
        results = asyncio.run(main())
    finally:
        client.close()
    assert [len(r["tokens"]) for r in results] == [4, 4, 4]
    assert all(r["deltas"][-1].finish_reason == "length" for r in results)
    assert_engine_clean(client._engine)
