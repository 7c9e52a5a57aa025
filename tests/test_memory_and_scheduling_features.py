"""Issue 5 features on tiny fp32 models: prefix caching, incremental KV, watermark, priority,
bounded bypass, lossless preemption, delayed and trace exits; all must leave outputs identical
to the plain engine (or to the oracle) and leak nothing."""

from __future__ import annotations

import json

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import SamplingParams
from rlt_contracts import ConfigurationError, InvalidRequestError

SHARED_PREFIX = [5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 9]
PROMPTS = [SHARED_PREFIX + tail for tail in ([31, 77], [18, 200, 201], [45], [16, 3, 8, 19, 21])]


def run(llm, prompts, params):
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]


def adaptive(n=6, **kw):
    return SamplingParams(max_tokens=n, exit_threshold=0.6, ignore_eos=True, **kw)


def seeded(count):
    return [
        SamplingParams(
            max_tokens=10, temperature=0.8, seed=45 + i, exit_threshold=0.6, ignore_eos=True
        )
        for i in range(count)
    ]


# -- prefix caching ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_prefix_cache_hits_give_cold_run_outputs(llm_factory, layout, kv):
    """Also with an fp8 KV cache: cached pages hold the same bytes a cold run writes."""
    cold = run(llm_factory(kv_layout=layout, kv_cache_dtype=kv), PROMPTS, adaptive())
    llm = llm_factory(kv_layout=layout, enable_prefix_caching=True, kv_cache_dtype=kv)
    first = run(llm, PROMPTS[:1], adaptive())  # publishes the shared prefix pages
    hot = run(llm, PROMPTS, adaptive())
    assert first == cold[:1] and hot == cold
    stats = llm.get_stats()
    # block size 4: the 12-token shared prefix is 3 full pages, reused by 4 requests + 1 repeat
    assert stats.prefix_cache_hit_tokens >= 4 * 12
    assert stats.prefix_cache_queried_tokens == sum(len(p) for p in PROMPTS[:1] + PROMPTS)


def test_prefix_cache_under_eviction_pressure_stays_correct(llm_factory):
    params = adaptive()
    cold = run(llm_factory(), PROMPTS, params)
    llm = llm_factory(enable_prefix_caching=True, num_kv_blocks=48, max_num_seqs=2)
    for _ in range(2):
        assert run(llm, PROMPTS, params) == cold
    assert llm.get_stats().prefix_cache_hit_tokens > 0


# -- incremental allocation, watermark -----------------------------------------------------------
def test_incremental_kv_claims_less_and_changes_nothing(llm_factory):
    full = llm_factory(block_size=2)
    incremental = llm_factory(block_size=2, incremental_kv=True)
    prompt, params = [[1, 2, 3, 4, 5]], SamplingParams(max_tokens=9, ignore_eos=True)
    used = {}
    for name, llm in (("full", full), ("incremental", incremental)):
        llm.engine.add_request("r", prompt[0], params)
        llm.engine.step()
        used[name] = llm.get_stats().kv_blocks_used
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    # full reservation: ceil((5 + 9 - 1) / 2) = 7 pages x 4 planes; incremental: the prompt
    # (3 pages) plus the first decode position, which still fits in page 3
    assert used == {"full": 28, "incremental": 12}
    assert run(full, prompt, params) == run(incremental, prompt, params)


def test_watermark_defers_admission_while_others_run(llm_factory):
    llm = llm_factory(num_kv_blocks=40, kv_watermark=0.7, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)  # 2 + 3 positions -> 2 pages x 4
    engine.add_request("a", [1, 2], params)
    engine.add_request("b", [3, 4], params)
    engine.step()
    # a holds 8 blocks; b needs 8 + 28 headroom (0.7 x 40) > 32 free -> waits until a is done
    assert engine.core.scheduler.num_running == 1 and engine.core.scheduler.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()


# -- priority and bounded bypass -----------------------------------------------------------------
def finish_order(llm, requests):
    engine, order = llm.engine, []
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        order.extend(o.request_id for o in engine.step() if o.finished)
    return order


def test_priority_policy_admits_lower_values_first(llm_factory):
    llm = llm_factory(scheduling_policy="priority", max_num_seqs=1)
    p = lambda prio: SamplingParams(max_tokens=3, ignore_eos=True, priority=prio)  # noqa: E731
    llm.engine.add_request("first", [1, 2], p(5))
    llm.engine.step()  # admitted alone; without preemption it runs to the end
    order = finish_order(
        llm,
        [
            ("normal", [4], p(0)),
            ("late", [6], p(7)),
            ("urgent", [3], p(-1)),
            ("normal2", [5], p(0)),
        ],
    )
    assert order == ["first", "urgent", "normal", "normal2", "late"]


def test_bounded_bypass_protects_a_long_waiting_request(llm_factory):
    """A request too large to fit next to the running one is passed by small ones only
    `max_admission_bypasses` times; then it is admitted before any newer small request."""
    llm = llm_factory(num_kv_blocks=64, max_num_seqs=4, max_admission_bypasses=2)
    engine = llm.engine
    small = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(
        "running", [1] * 20, SamplingParams(max_tokens=12, ignore_eos=True)
    )  # 32 blocks
    engine.step()
    engine.add_request("big", [2] * 40, SamplingParams(max_tokens=9, ignore_eos=True))  # 48 blocks
    admitted = []
    for i in range(6):
        engine.add_request(f"small{i}", [3], small)
    while engine.has_unfinished_requests():
        engine.step()
        for request_id in engine.core.scheduler.running_request_ids():
            if request_id not in admitted:
                admitted.append(request_id)
    big_at = admitted.index("big")
    assert admitted[1:big_at] == ["small0", "small1"]  # passed exactly twice, then protected


# -- preemption ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_preemption_under_memory_pressure_is_lossless(llm_factory, layout, kv):
    prompts = PROMPTS + [[60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    greedy = [adaptive(10)] * len(prompts)
    sampled = seeded(len(prompts))
    roomy = llm_factory(kv_layout=layout, kv_cache_dtype=kv)
    tight = llm_factory(
        kv_cache_dtype=kv,
        kv_layout=layout,
        num_kv_blocks=56 if layout == "last_exited" else 14,
        incremental_kv=True,
        enable_preemption=True,
    )
    for params in (greedy, sampled):
        assert run(tight, prompts, params) == run(roomy, prompts, params)
    stats = tight.get_stats()
    assert stats.preemptions > 0 and stats.resumptions == stats.preemptions


def test_priority_arrival_preempts_a_running_low_priority_request(llm_factory):
    llm = llm_factory(scheduling_policy="priority", enable_preemption=True, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True, priority=10))
    engine.step()
    engine.step()
    order = finish_order(
        llm, [("high", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True, priority=-10))]
    )
    assert order == ["high", "low"]
    assert llm.get_stats().preemptions == 1 and llm.get_stats().resumptions == 1
    alone = llm_factory().generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    low = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert low.token_ids == alone.token_ids


def test_abort_while_preempted_drops_the_snapshot(llm_factory):
    llm = llm_factory(scheduling_policy="priority", enable_preemption=True, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True, priority=10))
    engine.step()
    engine.step()
    engine.add_request("high", [4, 5], SamplingParams(max_tokens=6, ignore_eos=True, priority=-10))
    engine.step()  # "low" is snapshotted, "high" admitted
    assert len(engine.core.runner.snapshots) == 1
    assert engine.abort_request("low").finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # delivers the release of "high" to the runner
    assert len(engine.core.runner.snapshots) == 0 and len(engine.core.runner.rows) == 0


# -- exit policies -----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_delayed_exit_matches_oracle(llm_factory, tiny_checkpoint, layout):
    llm = llm_factory(kv_layout=layout, exit_policy="ouro_delayed")
    # this random model's gate is much less confident under SHARED, so early exits need a
    # lower threshold there
    threshold = {"last_exited": 0.5, "shared": 0.1}[layout]
    params = [
        SamplingParams(max_tokens=n, exit_threshold=threshold, ignore_eos=True) for n in (8, 6, 7)
    ]
    outputs = llm.generate(PROMPTS[:3], params)
    oracle = GenerationOracle(DenseOuro(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)), layout)
    for prompt, p, out in zip(PROMPTS, params, outputs, strict=False):
        ref = oracle.generate(
            OracleRequest(
                tuple(prompt),
                p.max_tokens,
                threshold=threshold,
                ignore_eos=True,
                exit_policy="ouro_delayed",
            )
        )
        assert ref.min_logit_margin > 1e-4 and ref.min_gate_margin > 1e-4
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)
    immediate = llm_factory(kv_layout=layout).generate(PROMPTS[:3], params)
    assert sum(sum(o.exit_depths) for o in outputs) > sum(sum(o.exit_depths) for o in immediate)


def test_recorded_trace_replays_exactly_without_gates(llm_factory, tmp_path, monkeypatch):
    recorded = llm_factory().generate(PROMPTS, adaptive(8))
    trace = {f"generate-{i}": o.exit_depths for i, o in enumerate(recorded)}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    replay = llm_factory(exit_policy="trace", exit_trace=str(path))
    model = replay.engine.core.runner.model
    monkeypatch.setattr(
        model, "exit_probability", lambda h: pytest.fail("trace replay computed the gate")
    )
    outputs = replay.generate(PROMPTS, adaptive(8))
    assert [(o.token_ids, o.exit_depths) for o in outputs] == [
        (o.token_ids, o.exit_depths) for o in recorded
    ]


def test_trace_errors_are_request_errors(llm_factory, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"short": [4, 2], "shallow": [4, 1, 1, 1], "deep": [3, 2, 2, 2]}))
    llm = llm_factory(exit_policy="trace", exit_trace=str(path))
    for request_id, message in (
        ("short", "cannot cover"),
        ("shallow", "outside"),
        ("deep", "prompt.s depth"),
        ("missing", "no depths"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            llm.engine.add_request(request_id, [1, 2], SamplingParams(max_tokens=4))


# -- configuration errors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"exit_policy": "trace"}, ("exit_policy", "exit_trace")),
        ({"exit_trace": "x.json"}, ("exit_trace", "exit_policy")),
        ({"kv_watermark": 1.0}, ("kv_watermark",)),
        ({"scheduling_policy": "lottery"}, ("scheduling_policy",)),
        ({"exit_policy": "random"}, ("exit_policy",)),
        ({"max_num_batched_token_loops": 5}, ("max_num_batched_token_loops", "max_num_seqs")),
    ],
)
def test_invalid_feature_combinations_fail_at_configuration(tiny_checkpoint, options, named):
    from rlt import LLM

    with pytest.raises(ConfigurationError) as info:
        LLM(
            tiny_checkpoint("l2_t4", seed=3, gate_std=0.3),
            device="cpu",
            max_num_seqs=4,
            max_num_batched_tokens=16,
            **options,
        )
    assert info.value.options == named


def test_token_loop_budget_limits_prefill_per_step(llm_factory):
    llm = llm_factory(
        max_num_batched_token_loops=24, prefill_chunk_size=64, max_num_batched_tokens=64
    )
    engine = llm.engine
    engine.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    step = engine.core.scheduler.schedule()
    assert step.num_prefill_tokens * 4 <= 24
    engine.core.scheduler.update_from_output(engine.core.runner.execute(step))
    engine.core.scheduler.take_outputs()
    while engine.has_unfinished_requests():
        engine.step()
