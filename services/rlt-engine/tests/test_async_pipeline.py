"""The asynchronous pipeline (one step in flight, several ticks per step) gives exactly the
results of synchronous one-tick steps: greedy and seeded sampling, both layouts, both modes,
under preemption and prefix caching, with aborts and request-id reuse in the middle; and an
engine that is shut down refuses work and holds nothing."""

from __future__ import annotations

import pytest
from rlt import SamplingParams
from rlt_contracts import EngineDeadError

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13],
    [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 14, 15],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3],
    [7],
]


def params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=9 + i,
        exit_threshold=(0.55, 0.8, 1.0)[i % 3],
        ignore_eos=True,
        temperature=0.0 if i % 2 else 0.9,
        top_p=0.95,
        seed=100 + i,
        logprobs=2 if i == 3 else None,
    )


def scenario(llm) -> dict:
    """Add requests, abort one after a few steps, reuse its id, run to the end. Returns the
    final outputs of every request that was not aborted."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params(i))
    finals = {}
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.abort_request("r1")
    finals.pop("r1", None)
    # the id again, a new request whose prompt starts like r0's (a prefix cache hit, if on)
    engine.add_request("r1", PROMPTS[0][:8] + [6], params(1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return {rid: o for rid, o in sorted(finals.items())}


def assert_same(got: dict, expected: dict) -> None:
    """Tokens, depths and finish reasons exactly; logprobs to fp32 rounding (a row's logits
    may be computed in batches of other shapes, which reorders fp32 sums)."""
    assert list(got) == list(expected)
    for rid, out in got.items():
        ref = expected[rid]
        assert (out.token_ids, out.exit_depths, out.finish_reason) == (
            ref.token_ids,
            ref.exit_depths,
            ref.finish_reason,
        ), rid
        if ref.logprobs is not None:
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_layout="last_exited"),
        dict(kv_layout="shared"),
        dict(scheduling_mode="no_refill"),
        dict(enable_prefix_caching=True),
        dict(num_kv_blocks=40, incremental_kv=True, enable_preemption=True),
    ],
    ids=["last_exited", "shared", "no_refill", "prefix_cache", "preemption"],
)
def test_async_multi_tick_steps_equal_synchronous_single_ticks(llm_factory, options):
    reference = scenario(llm_factory(async_scheduling=False, decode_ticks_per_step=1, **options))
    pipelined = llm_factory(async_scheduling=True, decode_ticks_per_step=8, **options)
    assert_same(scenario(pipelined), reference)
    assert set(reference) == {"r0", "r1", "r2", "r3", "r4"}
    if "enable_preemption" in options:
        assert pipelined.get_stats().preemptions > 0
    if "enable_prefix_caching" in options:
        assert pipelined.get_stats().prefix_cache_hit_tokens > 0


def test_shutdown_refuses_work_and_context_manager_closes(llm_factory):
    llm = llm_factory()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    llm.engine.add_request("left", [4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    with llm_factory() as other:
        assert len(other.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    with pytest.raises(EngineDeadError):
        other.engine.step()


# -- prompts arriving while others decode (served load) ---------------------------------------
STAGGERED_REGEX = r"[a-c]{2,6}"


def staggered(llm) -> dict:
    """Two requests decode; the others arrive one or two steps apart (as served requests do,
    each after its own round trip), one of them constrained by a grammar. Returns every
    request's final output."""
    from rlt_contracts import StructuredOutput

    engine = llm.engine
    arrivals = {0: [0, 1], 2: [2], 3: [3], 5: [4], 6: ["grammar"]}
    finals, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, ()):
            if i == "grammar":
                spec = StructuredOutput(kind="regex", regex=STAGGERED_REGEX)
                engine.add_request(
                    "g", [9, 10, 11], SamplingParams(max_tokens=8, structured_output=spec)
                )
            else:
                engine.add_request(f"r{i}", PROMPTS[i], params(i))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return {rid: o for rid, o in sorted(finals.items())}


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(enable_prefix_caching=True, incremental_kv=True),
        dict(scheduling_mode="no_refill"),
    ],
    ids=["default", "prefix_cache_incremental", "no_refill"],
)
def test_prompt_step_ticks_and_admission_delay_change_no_output(llm_factory, options):
    """`prefill_step_decode_ticks` and `scheduler_delay_factor` are scheduling choices: tokens,
    exit depths and finish reasons stay those of today's rule (greedy and seeded sampling,
    fp32), and no KV block is left held (llm_factory checks)."""
    reference = staggered(llm_factory(**options))
    assert set(reference) == {"r0", "r1", "r2", "r3", "r4", "g"}
    for arm in (
        dict(prefill_step_decode_ticks="auto"),
        dict(prefill_step_decode_ticks=3, decode_ticks_per_step=4),
        dict(scheduler_delay_factor=2.0),
        dict(prefill_step_decode_ticks="auto", scheduler_delay_factor=0.5),
    ):
        assert_same(staggered(llm_factory(**options, **arm)), reference)
