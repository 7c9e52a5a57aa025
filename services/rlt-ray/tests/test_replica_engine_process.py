"""`EngineReplica` with its engine core in a process of its own (the GPU default) against the
engine on a thread (the CPU default), called directly, without a Ray cluster: the same tokens,
exit depths and text; a dead core fails the health check; stopping the replica stops the core."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from rlt.engine.config import EngineConfig
from rlt_contracts import EngineRequest, RequestOutputDelta, SamplingParams
from rlt_ray.replicas import EngineReplica
from rlt_ray.wire import Accepted, Finished

CONFIG = dict(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=256, block_size=4)
PROMPTS = [(5, 17, 200, 3, 99), (250, 11), (64, 128, 9, 31, 77, 18)]
PARAMS = SamplingParams(max_tokens=12, exit_threshold=0.7, ignore_eos=True, logprobs=1)


async def replica(checkpoint, engine_process: bool) -> EngineReplica:
    made = EngineReplica.__new__(EngineReplica)  # Ray Serve awaits the async constructor
    await made.__init__(
        EngineConfig.from_options(model=checkpoint, **CONFIG), engine_process=engine_process
    )
    return made


async def generate(made: EngineReplica, index: int, prompt) -> tuple:
    items = [item async for item in made.generate(EngineRequest(f"r{index}", prompt, PARAMS))]
    assert isinstance(items[0], Accepted) and isinstance(items[-1], Finished)
    deltas = [d for d in items if isinstance(d, RequestOutputDelta)]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.token_ids]
    depths = [t for d in deltas for t in d.exit_depths]
    return tokens, depths, "".join(d.text for d in deltas)


async def run_all(made: EngineReplica) -> list:
    return await asyncio.gather(*(generate(made, i, p) for i, p in enumerate(PROMPTS)))


def test_the_engine_process_gives_the_threads_outputs_and_its_death_fails_the_health_check(
    tiny_checkpoint,
):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)

    async def main():
        threaded = await replica(checkpoint, engine_process=False)
        try:
            expected = await run_all(threaded)
        finally:
            await threaded.__del__()
        separate = await replica(checkpoint, engine_process=True)
        core = separate.core.process
        try:
            got = await run_all(separate)
            await separate.check_health()
            assert (await separate.record_routing_stats())["ongoing"] == 0
            os.kill(core.pid, signal.SIGKILL)
            for _ in range(100):  # the liveness pipe reports the death on the replica's loop
                if separate.client.dead is not None:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match="not running"):
                await separate.check_health()
        finally:
            await separate.__del__()
        return expected, got, core

    expected, got, core = asyncio.run(main())
    assert got == expected
    assert all(len(tokens) == 12 for tokens, _, _ in got)
    assert not core.is_alive()


def test_stopping_the_replica_stops_its_engine_process(tiny_checkpoint):
    checkpoint = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)

    async def main():
        separate = await replica(checkpoint, engine_process=True)
        [(tokens, _, _)] = await asyncio.gather(generate(separate, 0, PROMPTS[0]))
        core = separate.core.process
        await separate.__del__()
        return tokens, core

    tokens, core = asyncio.run(main())
    assert len(tokens) == 12
    core.join(5)
    assert not core.is_alive() and core.exitcode == 0
