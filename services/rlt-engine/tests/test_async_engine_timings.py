"""`AsyncEngine` hands each request's `RequestTimings` to the frontend on its final delta only,
whether the stream is read live, read late (everything in one delta), or cancelled."""

from __future__ import annotations

import asyncio
import time

import pytest
from rlt.engine import EngineConfig, LLMEngine
from rlt.serving import AsyncEngine
from rlt_contracts import EngineRequest, FinishReason, SamplingParams
from serving_harness import ENGINE_DEFAULTS

PARAMS = SamplingParams(max_tokens=8, exit_threshold=0.8, ignore_eos=True)


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_options(model=checkpoint, **ENGINE_DEFAULTS)))
    yield engine
    engine.close(timeout=30)


def check_final_only(deltas) -> None:
    assert [d.timings is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    t = deltas[-1].timings
    assert t.queued <= t.scheduled <= t.first_token <= t.last_token
    assert t.queue_time >= 0 and t.decode_time >= 0


def test_live_and_late_readers_get_the_timings_on_the_final_delta(client):
    async def main():
        await client.submit(EngineRequest("live", (5, 17, 200, 3), PARAMS))
        live = [d async for d in client.stream("live")]
        await client.submit(EngineRequest("late", (5, 17, 200, 3), PARAMS))
        deadline = time.monotonic() + 10
        while not client._streams["late"].state.ended:  # its final delta arrived, unread
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        late = [d async for d in client.stream("late")]  # everything waiting, in one take
        return live, late

    live, late = asyncio.run(main())
    check_final_only(live)
    [merged] = late
    check_final_only(late)
    assert len(merged.token_ids) == 8 == sum(len(d.token_ids) for d in live)


def test_a_cancelled_request_reports_how_far_it_got(client):
    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        await client.submit(EngineRequest("cancelled", (1, 2, 3), params))
        deltas = []
        async for delta in client.stream("cancelled"):
            deltas.append(delta)
            if len(deltas) == 1:
                await client.cancel("cancelled")
        return deltas

    deltas = asyncio.run(main())
    assert deltas[-1].finish_reason is FinishReason.ABORT
    check_final_only(deltas)
