"""Self-speculative decoding is lossless (issue 21), on tiny fp32 models on the CPU.

Greedy: tokens AND exit depths equal the engine without speculation for every exit policy
(fixed depth, ouro hazard, ouro_delayed, trace), both KV layouts, refill and no_refill, K in
{1, 3, 5} drafts and D in {1, 2} draft loops; the runs also check that drafts were really
accepted (so the accept path, not only the rejection path, is covered). The same holds with
prefix caching, preemption, siblings (n = 2), stop strings and stop ids, max_tokens at every
boundary, aborts and request-id reuse, the asynchronous pipeline, and against the independent
dense fp64 reference. Rows that cannot draft (penalties) give exactly the plain engine's
tokens even when sampled. Sampled rows follow the plain engine's distribution (a two-sample
chi-square test over many seeds; the sampler's own rejection test is exact, see
packages/rlt-sampling/tests/test_speculative.py).

Logprobs: the verify pass computes the log-softmax of the same hidden states as plain decoding
but in calls of a different shape (K + 1 positions per row), so fp32 rounding may differ:
|difference| <= 1e-5 (logprobs here are O(1); fp32 rounding of a log-softmax over 320 logits
is ~1e-6).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt import LLM, SamplingParams
from rlt.cli import build_parser
from rlt.engine import EngineConfig
from rlt_contracts import ConfigurationError, EngineRequest, option_fields

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [250, 11],
    [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3, 8, 19],
    [7],
]
MAX_TOKENS = [9, 6, 11, 8]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=512,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)
# (exit policy, request loop settings): fixed depth, the hazard rule with early exits, the
# delayed rule, and a recorded trace (written per test from the plain hazard run)
POLICIES = {
    "fixed": ("ouro", dict(exit_threshold=1.0)),
    "ouro": ("ouro", dict(exit_threshold=0.55, min_loops=1)),
    "delayed": ("ouro_delayed", dict(exit_threshold=0.6, min_loops=1)),
    "trace": ("trace", dict(min_loops=1)),
}
# (K drafts, D draft loops, scheduling mode): every K and D, both modes
CASES = [(1, 1, "refill"), (3, 2, "no_refill"), (5, 2, "refill"), (5, 1, "no_refill")]


def outputs(llm, prompts=PROMPTS, params=None):
    params = params or greedy()
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]


def greedy(policy: str = "ouro", **extra) -> list[SamplingParams]:
    loops = POLICIES[policy][1]
    return [SamplingParams(max_tokens=n, ignore_eos=True, **loops, **extra) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


@pytest.fixture(scope="module")
def trace_file(checkpoint, tmp_path_factory):
    """Exit depths of the plain hazard run, replayed by the trace policy (request ids of a
    fresh LLM's first generate call)."""
    llm = LLM(checkpoint, **ENGINE)
    recorded = llm.generate(PROMPTS, greedy("ouro"))
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    path.write_text(json.dumps({f"generate-{i}": o.exit_depths for i, o in enumerate(recorded)}))
    return str(path)


@pytest.fixture(scope="module")
def plain(checkpoint, trace_file):
    """Plain-engine outputs per (layout, policy), computed once."""
    cache = {}

    def get(layout: str, policy: str):
        if (layout, policy) not in cache:
            cache[layout, policy] = outputs(
                engine(checkpoint, trace_file, layout, policy), params=greedy(policy)
            )
        return cache[layout, policy]

    return get


def engine(checkpoint, trace_file, layout, policy, **options) -> LLM:
    exit_policy = POLICIES[policy][0]
    trace = dict(exit_trace=trace_file) if exit_policy == "trace" else {}
    options = {**ENGINE, **trace, **options}
    return LLM(checkpoint, kv_layout=layout, exit_policy=exit_policy, **options)


def speculative(k: int = 3, d: int = 2, **options) -> dict:
    return dict(num_speculative_tokens=k, speculative_draft_loops=d, **options)


def assert_clean(llm: LLM) -> None:
    assert llm.engine.core.leak_report() == []


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_tokens_and_exit_depths_equal_plain_decoding(
    checkpoint, trace_file, plain, layout, policy
):
    """LAST_EXITED: two (K, D, mode) cases per policy, all of CASES over the policies; SHARED
    (whose verify runs position by position: slow on the CPU) one case per policy."""
    expected = plain(layout, policy)
    first = list(POLICIES).index(policy)
    cases = [CASES[first], CASES[(first + 2) % 4]] if layout == "last_exited" else [CASES[first]]
    accepted = 0
    for k, d, mode in cases:
        llm = engine(
            checkpoint, trace_file, layout, policy, scheduling_mode=mode, **speculative(k, d)
        )
        assert outputs(llm, params=greedy(policy)) == expected, (k, d, mode)
        stats = llm.get_stats()
        assert stats.spec_drafts > 0 and len(stats.spec_accepted_per_position) == k
        accepted += stats.spec_accepted_tokens
        assert_clean(llm)
    if policy != "fixed" and any(d == 2 for _, d, _ in cases):
        # early exits at or below the draft depth make drafts agree with the target
        assert accepted > 0, "no draft was ever accepted: the accept path went untested"


def test_speculative_engine_matches_the_dense_reference(checkpoint):
    llm = LLM(checkpoint, **ENGINE, **speculative(3, 2))
    oracle = GenerationOracle(DenseOuro(checkpoint), "last_exited")
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        reference = oracle.generate(
            OracleRequest(tuple(prompt), n, min_loops=1, threshold=0.55, ignore_eos=True)
        )
        assert reference.min_logit_margin > 1e-4 and reference.min_gate_margin > 1e-4
        params = SamplingParams(max_tokens=n, exit_threshold=0.55, min_loops=1, ignore_eos=True)
        [out] = llm.generate([prompt], params)
        assert (out.token_ids, out.exit_depths) == (reference.token_ids, reference.exit_depths)
    assert llm.get_stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_prefix_cache_hits_and_preemption_keep_outputs(checkpoint, trace_file, plain, layout):
    shared_prefix = [5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 9]
    prompts = [shared_prefix + tail for tail in ([31, 77], [18, 200, 201], [45], [16, 3, 8])]
    params = greedy()
    expected = outputs(engine(checkpoint, trace_file, layout, "ouro"), prompts, params)
    cached = engine(
        checkpoint, trace_file, layout, "ouro", enable_prefix_caching=True, **speculative()
    )
    assert outputs(cached, prompts[:1], params[:1]) == expected[:1]
    assert outputs(cached, prompts, params) == expected
    assert cached.get_stats().prefix_cache_hit_tokens >= 4 * 12
    tight = engine(
        checkpoint,
        trace_file,
        layout,
        "ouro",
        num_kv_blocks=60 if layout == "last_exited" else 15,
        incremental_kv=True,
        enable_preemption=True,
        **speculative(),
    )
    assert outputs(tight, prompts, params) == expected
    stats = tight.get_stats()
    assert stats.preemptions > 0 and stats.resumptions == stats.preemptions
    for llm in (cached, tight):
        assert_clean(llm)


def test_siblings_stop_conditions_and_max_tokens(checkpoint):
    plain, spec = LLM(checkpoint, **ENGINE), LLM(checkpoint, **ENGINE, **speculative(5, 2))
    # max_tokens at every boundary of a round (1 = token 0 only, up to more than one round)
    for n in (1, 2, 3, 6, 7):
        params = SamplingParams(max_tokens=n, exit_threshold=0.55, min_loops=1, ignore_eos=True)
        assert outputs(spec, PROMPTS, [params] * 4) == outputs(plain, PROMPTS, [params] * 4)
    # a stop id inside an accepted run of drafts ends the request right there
    loops = dict(max_tokens=9, exit_threshold=0.55, min_loops=1, ignore_eos=True)
    free = spec.generate([PROMPTS[0]], SamplingParams(**loops))[0]
    stop_at = free.token_ids[4]
    stopped = spec.generate([PROMPTS[0]], SamplingParams(**loops, stop_token_ids=(stop_at,)))
    cut = free.token_ids.index(stop_at)
    assert stopped[0].token_ids == free.token_ids[: cut + 1]
    assert stopped[0].finish_reason == "stop"
    # stop strings (host side) cut the text exactly as without speculation
    text = spec.generate(["The river"], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    needle = text[len(text) // 2 :][:2]
    stop = SamplingParams(max_tokens=12, ignore_eos=True, stop=(needle,))
    assert spec.generate(["The river"], stop)[0].text == plain.generate(["The river"], stop)[0].text
    # siblings (the n choices of one request) share one prompt computation
    engines = [
        LLM(checkpoint, **ENGINE, enable_prefix_caching=True, **options)
        for options in ({}, speculative(3, 1))
    ]
    results = []
    for llm in engines:
        core = llm.engine
        core.add_requests(
            [
                EngineRequest(
                    f"n-{i}",
                    tuple(range(10, 30)),
                    SamplingParams(max_tokens=7, exit_threshold=0.55, min_loops=1, ignore_eos=True),
                    sibling_group="n",
                )
                for i in range(2)
            ]
        )
        finished = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = (out.token_ids, out.exit_depths)
        results.append(finished)
        assert llm.get_stats().prefix_cache_hit_tokens > 0
    assert results[0] == results[1]
    for llm in (plain, spec, *engines):
        assert_clean(llm)


def test_abort_mid_round_and_reused_id_never_mix(checkpoint):
    llm = LLM(checkpoint, **ENGINE, **speculative(3, 2))
    engine_ = llm.engine
    params = SamplingParams(max_tokens=30, exit_threshold=0.55, min_loops=1, ignore_eos=True)
    engine_.add_request("req", PROMPTS[2], params)
    engine_.add_request("other", PROMPTS[0], params)
    for _ in range(4):
        engine_.step()
    assert engine_.abort_request("req").finish_reason == "abort"
    fresh = SamplingParams(max_tokens=6, exit_threshold=0.55, min_loops=1, ignore_eos=True)
    engine_.add_request("req", PROMPTS[1], fresh)
    finals = {}
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                finals[out.request_id] = out
    reference = LLM(checkpoint, **ENGINE).generate([PROMPTS[1], PROMPTS[0]], [fresh, params])
    assert (finals["req"].token_ids, finals["req"].exit_depths) == (
        reference[0].token_ids,
        reference[0].exit_depths,
    )
    assert finals["other"].token_ids == reference[1].token_ids
    assert_clean(llm)


def test_logprobs_async_pipeline_and_the_disable_limit(checkpoint):
    """With the limit at 2 the four requests decode with ticks until the two short ones end,
    then the two long ones speculate."""
    params = [
        SamplingParams(max_tokens=n, exit_threshold=0.55, min_loops=1, ignore_eos=True, logprobs=3)
        for n in (6, 5, 24, 20)
    ]
    plain = LLM(checkpoint, **ENGINE).generate(PROMPTS, params)
    for options in (
        speculative(),
        speculative(async_scheduling=False),
        speculative(speculative_disable_batch_size=2),
    ):
        llm = LLM(checkpoint, **ENGINE, **options)
        got = llm.generate(PROMPTS, params)
        for a, b in zip(plain, got, strict=True):
            assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
            for top_a, top_b in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert llm.get_stats().spec_drafts > 0
        assert_clean(llm)


def test_rows_that_cannot_draft_decode_exactly_as_without_speculation(checkpoint):
    """Penalties disable drafting for their request (0 drafts): even sampled, its tokens are
    the plain engine's, next to requests that do draft."""
    params = [
        SamplingParams(
            max_tokens=8, temperature=0.9, seed=7 + i, repetition_penalty=1.3, ignore_eos=True
        )
        for i in range(len(PROMPTS))
    ]
    params[1] = SamplingParams(max_tokens=8, exit_threshold=0.55, ignore_eos=True)  # drafts
    plain = outputs(LLM(checkpoint, **ENGINE), PROMPTS, params)
    llm = LLM(checkpoint, **ENGINE, **speculative())
    assert outputs(llm, PROMPTS, params) == plain
    assert llm.get_stats().spec_drafts > 0
    assert_clean(llm)


def test_sampled_outputs_follow_the_plain_distribution(checkpoint):
    """Two-sample chi-square test: 600 seeds with and without speculation (K = 3, D = 1:
    drafts often rejected, so the residual draw is exercised); for output tokens 1..3 the
    counts of the 6 most frequent tokens plus "other" must be homogeneous at p > 1e-3 each
    (chi-square, 6 degrees of freedom: statistic < 22.46)."""
    seeds = range(600)
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_k=12, seed=s, ignore_eos=True)
        for s in seeds
    ]
    options = dict(ENGINE, max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=1024)
    prompt = [[5, 17, 200, 3]] * len(params)
    plain = [o.token_ids for o in LLM(checkpoint, **options).generate(prompt, params)]
    llm = LLM(checkpoint, **options, **speculative(3, 1, speculative_disable_batch_size=None))
    spec = [o.token_ids for o in llm.generate(prompt, params)]
    stats = llm.get_stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert plain != spec  # another random stream: different samples, same distribution
    for index in (1, 2, 3):
        a = Counter(t[index] for t in plain)
        b = Counter(t[index] for t in spec)
        top = [t for t, _ in (a + b).most_common(6)]
        table = [[c[t] for t in top] + [sum(c.values()) - sum(c[t] for t in top)] for c in (a, b)]
        assert _chi_square(table) < 22.46, (index, table)
    assert_clean(llm)


def _chi_square(table: list[list[int]]) -> float:
    rows = [sum(r) for r in table]
    columns = [sum(c) for c in zip(*table, strict=True)]
    total = sum(rows)
    statistic = 0.0
    for i, row in enumerate(table):
        for j, observed in enumerate(row):
            expected = rows[i] * columns[j] / total
            if expected:
                statistic += (observed - expected) ** 2 / expected
    return statistic


def test_options_are_validated_and_acceptance_forcing_is_not_an_option(checkpoint):
    with pytest.raises(ConfigurationError) as error:
        LLM(checkpoint, **ENGINE, **speculative(3, 4))  # depth 4: drafts must use fewer loops
    assert "speculative_draft_loops" in str(error.value.options)
    for bad in (dict(num_speculative_tokens=-1), dict(speculative_draft_loops=0)):
        with pytest.raises(ConfigurationError):
            EngineConfig.from_options(device="cpu", **bad)
    with pytest.raises(ConfigurationError):
        EngineConfig.from_options(device="cpu", speculative_disable_batch_size=0)
    # the benchmark's forced acceptance is a method of the runner's program, never an option
    names = {f.name for f in option_fields(EngineConfig)}
    assert not {n for n in names if "forc" in n or "alpha" in n or "accept" in n}
    args = build_parser().parse_args(
        [
            "serve",
            "--num-speculative-tokens",
            "4",
            "--speculative-draft-loops",
            "1",
            "--speculative-disable-batch-size",
            "none",
        ]
    )
    assert (args.num_speculative_tokens, args.speculative_draft_loops) == (4, 1)
    assert args.speculative_disable_batch_size is None
    # (vLLM's --enforce-eager is about CUDA graphs, not acceptance)
    assert not any(("forc" in a and a != "enforce_eager") or "accept" in a for a in vars(args))
