"""Siblings (`EngineRequest.sibling_group`) in the real engine, without HTTP: the prompt is
computed once under both KV layouts and the siblings' outputs equal independent requests';
aborting a group midway (the computing sibling included) leaks nothing, and reusing the same
request ids and group afterwards gives the same results as a fresh engine."""

from __future__ import annotations

import pytest
from rlt import SamplingParams
from rlt.engine import EngineConfig, LLMEngine
from rlt_contracts import EngineRequest
from serving_harness import ENGINE_DEFAULTS

PROMPT = tuple(range(10, 74))  # 64 tokens, block size 4: 15 publishable pages


def engine(checkpoint, **options) -> LLMEngine:
    config = {**ENGINE_DEFAULTS, "enable_prefix_caching": True, **options}
    return LLMEngine(EngineConfig.from_options(model=checkpoint, **config))


def group(name: str, count: int, *, max_tokens: int = 6) -> list[EngineRequest]:
    return [
        EngineRequest(
            f"{name}-{i}",
            PROMPT,
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i, ignore_eos=True),
            sibling_group=name,
        )
        for i in range(count)
    ]


def run(llm: LLMEngine) -> dict[str, list[int]]:
    finished = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
    return finished


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_siblings_compute_the_prompt_once_and_match_independent_requests(checkpoint, layout):
    with (
        engine(checkpoint, kv_layout=layout) as shared,
        engine(checkpoint, kv_layout=layout, enable_prefix_caching=False) as alone,
    ):
        shared.add_requests(group("g", 4))
        got = run(shared)
        stats = shared.get_stats()
        assert stats.prompt_tokens == 64 + 3 * 4 and stats.prefix_cache_hit_tokens == 3 * 60
        alone.add_requests(group("g", 4))
        assert run(alone) == got
        assert alone.get_stats().prompt_tokens == 4 * 64
        assert shared.core.leak_report() == [] and alone.core.leak_report() == []


def test_aborting_a_group_midway_then_reusing_its_ids(checkpoint):
    with engine(checkpoint) as llm, engine(checkpoint) as fresh:
        llm.add_requests(group("g", 3, max_tokens=40))
        for _ in range(3):  # the first sibling is still computing the prompt
            llm.step()
        assert llm.core.scheduler.running_request_ids() == ["g-0"]
        for i in range(3):
            assert llm.abort_request(f"g-{i}") is not None
        assert llm.core.leak_report() == []
        llm.add_requests(group("g", 3, max_tokens=40))
        for _ in range(6):
            llm.step()
        assert sorted(llm.core.scheduler.running_request_ids()) == ["g-0", "g-1", "g-2"]
        for i in range(3):  # every sibling running now
            llm.abort_request(f"g-{i}")
        assert llm.core.leak_report() == []
        llm.add_requests(group("g", 3))
        fresh.add_requests(group("g", 3))
        assert run(llm) == run(fresh)
        assert llm.core.leak_report() == []
