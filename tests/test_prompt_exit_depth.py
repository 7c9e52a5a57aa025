"""Prompt scoring at each position's exit depth (issue 25 part 2, `score_at_exit_depth`), tiny fp32
models on the CPU, through `EngineCore` (scheduler + runner; no frontend):

- every prompt token's log-probability and exit depth equal the independent fp64 oracle's
  teacher-forced decode of the prompt from position 0 under the same exit rule (ouro and
  ouro_delayed, two thresholds, min/max loops, both KV layouts, prompts in several chunks and
  mixed in one step with plain and full-depth-scored requests), and so do the generated tokens
  that follow (token 0 from the last prompt position's exit state, then ordinary decoding);
- full-depth scoring and plain requests in the same steps are unchanged;
- the choices of a question share their context through the prefix cache (pages published
  under the exit rule's salt with their scores and depths), still equal to teacher forcing,
  while prefill's pages and theirs never serve each other;
- nothing leaks.
"""

from __future__ import annotations

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle, OracleRequest
from rlt.engine.assembly import build_engine
from rlt.engine.config import EngineConfig
from rlt_contracts import EngineRequest, SamplingParams

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11], [250, 11, 64], [64, 128, 9, 31, 77, 18]]
LOOP_SETTINGS = [  # (exit_threshold, min_loops, max_loops)
    (0.5, 1, None),
    (0.7, 2, None),
    (0.5, 2, 3),
]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
    decode_ticks_per_step=4,
)
MAX_TOKENS = 4
MARGIN = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


def at_exit_depth(threshold: float, min_loops: int, max_loops: int | None, **extra):
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        prompt_logprobs=1,
        score_at_exit_depth=True,
        exit_threshold=threshold,
        min_loops=min_loops,
        max_loops=max_loops,
        ignore_eos=True,
        **extra,
    )


class Finished:
    """One request's deltas merged."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.exit_depths: list[int] = []
        self.prompt_logprobs = None
        self.prompt_exit_depths = None

    def add(self, delta) -> None:
        self.token_ids += delta.token_ids
        self.exit_depths += delta.exit_depths
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_exit_depths = delta.prompt_exit_depths


def run(core, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Finished]:
    core.add_requests([EngineRequest(rid, tuple(p), params) for rid, p, params in requests])
    finished = {rid: Finished() for rid, _, _ in requests}
    while core.has_unfinished_requests():
        for delta in core.step():
            finished[delta.request_id].add(delta)
    assert core.leak_report() == []
    return finished


def make_core(checkpoint, **options):
    return build_engine(
        EngineConfig.from_options(model=str(checkpoint), **{**ENGINE, **options})
    ).core


def assert_equals_teacher_forced(oracle, prompt, params, policy, got: Finished) -> None:
    want = oracle.generate(
        OracleRequest(
            tuple(prompt),
            MAX_TOKENS,
            min_loops=params.min_loops,
            max_loops=params.max_loops,
            threshold=params.exit_threshold,
            ignore_eos=True,
            exit_policy=policy,
            prompt_at_exit_depth=True,
        )
    )
    # the comparison is well conditioned: no exit decision and no greedy choice within 1e-4
    # of flipping (fp32 engine against the fp64 oracle, as test_engine_matches_oracle.py)
    assert want.min_gate_margin > MARGIN and want.min_logit_margin > MARGIN
    assert got.prompt_exit_depths == tuple(want.prompt_exit_depths)
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
    assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths)


@pytest.mark.parametrize("policy", ["ouro", "ouro_delayed"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_exit_depth_scores_equal_teacher_forced_decoding(checkpoint, layout, policy):
    core = make_core(checkpoint, kv_layout=layout, exit_policy=policy)
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)
    requests = [
        (f"r{i}-{j}", prompt, at_exit_depth(*loops))
        for i, loops in enumerate(LOOP_SETTINGS)
        for j, prompt in enumerate(PROMPTS[::2])  # 11 tokens (3 chunks) and 6
    ]
    # in the same steps: a full-depth scored prompt and a plain one, which must not change
    full_depth = SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=1, ignore_eos=True)
    plain = SamplingParams(max_tokens=MAX_TOKENS, exit_threshold=0.6, ignore_eos=True)
    fixed_depth = at_exit_depth(1.0, 2, None)  # threshold 1: every position runs 4 loops
    requests += [
        ("fixed", PROMPTS[0], fixed_depth),
        ("full", PROMPTS[0], full_depth),
        ("plain", PROMPTS[2], plain),
    ]
    finished = run(core, requests)
    core.close()
    depths = set()
    for rid, prompt, params in requests[:-3]:
        assert_equals_teacher_forced(oracle, prompt, params, policy, finished[rid])
        depths.update(finished[rid].prompt_exit_depths[1:])
    assert len(depths) >= 3  # the positions really exit at different depths
    full = finished["full"]
    assert full.prompt_exit_depths is None
    want = oracle.prompt_logprobs(tuple(PROMPTS[0]))
    assert full.prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert full.exit_depths[0] == 4
    fixed = finished["fixed"]
    assert fixed.prompt_exit_depths[1:] == (4,) * (len(PROMPTS[0]) - 1)
    assert fixed.prompt_logprobs[1:] == pytest.approx(full.prompt_logprobs[1:], abs=1e-5)
    assert fixed.token_ids == full.token_ids and fixed.exit_depths[0] == 4
    reference = oracle.generate(
        OracleRequest(tuple(PROMPTS[2]), MAX_TOKENS, threshold=0.6, ignore_eos=True,
                      exit_policy=policy)
    )  # fmt: skip
    assert finished["plain"].prompt_logprobs is None
    assert finished["plain"].token_ids == reference.token_ids


CONTEXT = [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 64, 128]  # 13 tokens: 3 full pages of 4
CHOICES = [[31, 77], [18], [250, 11, 9], [42, 42]]


@pytest.mark.parametrize("policy", ["ouro", "ouro_delayed"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_choices_scored_at_exit_depth_share_their_context_through_the_prefix_cache(
    checkpoint, layout, policy
):
    """4 choices after one 13-token context, scored at exit depth: the first computes the
    context and publishes its 3 full pages (decode KV) under its exit rule's salt with their
    scores and depths; the other 3 (one batch) reuse them and compute from position 12. Every
    choice still equals the teacher-forced decode and the cold engine. A prefill page (a plain
    prompt's) is no hit for them, and their pages are no hit for a plain prompt, a full-depth
    scored one or another threshold."""
    params = at_exit_depth(0.5, 1, None)
    prompts = [CONTEXT + choice for choice in CHOICES]
    requests = [(f"c{i}", p, params) for i, p in enumerate(prompts)]
    cold = make_core(checkpoint, kv_layout=layout, exit_policy=policy)
    reference = run(cold, requests)  # no cache: every choice computes the context
    cold.close()
    core = make_core(checkpoint, kv_layout=layout, exit_policy=policy, enable_prefix_caching=True)
    got = run(core, requests[:1])
    assert core.stats().prefix_cache_hit_tokens == 0
    got.update(run(core, requests[1:]))
    stats = core.stats()
    assert stats.prefix_cache_hit_tokens == 3 * 12  # the context's 3 full pages, per choice
    assert stats.prompt_tokens == len(prompts[0]) + sum(len(p) - 12 for p in prompts[1:])
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)
    for rid, prompt, _ in requests:
        assert_equals_teacher_forced(oracle, prompt, params, policy, got[rid])
        want = reference[rid]
        assert got[rid].prompt_exit_depths == want.prompt_exit_depths
        assert got[rid].prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-5)
    # salted pages serve only the same exit rule: not a plain prompt (which then publishes
    # prefill pages of the context), not a full-depth scored one, not another threshold, which
    # finds neither the 0.5 pages nor prefill's
    plain = SamplingParams(max_tokens=MAX_TOKENS, exit_threshold=0.5, ignore_eos=True)
    full_depth = SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=1, ignore_eos=True)
    run(core, [("plain", prompts[1], plain), ("full", prompts[2], full_depth)])
    run(core, [("other", prompts[3], at_exit_depth(0.7, 1, None))])
    assert core.stats().prefix_cache_hit_tokens == 3 * 12
    core.close()


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_choices_submitted_together_compute_their_context_once_at_exit_depth(checkpoint, layout):
    """The 4 choices in one call, before any has published the context: the first computes it,
    the others wait until its salted pages are read back (rlt-scheduler's prefix waits) and
    take them with their scores and depths (3 x 12 hits); each still equals the teacher-forced
    decode and the cold engine. Aborting the computing choice before its pages are read back
    releases the others: the next one computes the context and the last two reuse it."""
    params = at_exit_depth(0.5, 1, None)
    prompts = [CONTEXT + choice for choice in CHOICES]
    requests = [(f"c{i}", p, params) for i, p in enumerate(prompts)]
    cold = make_core(checkpoint, kv_layout=layout)
    reference = run(cold, requests)
    cold.close()
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)

    def assert_as_cold(got: Finished, rid: str, prompt) -> None:
        assert_equals_teacher_forced(oracle, prompt, params, "ouro", got)
        want = reference[rid]
        assert got.prompt_exit_depths == want.prompt_exit_depths
        assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-5)
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths)

    core = make_core(checkpoint, kv_layout=layout, enable_prefix_caching=True)
    got = run(core, requests)  # one add_requests call, then steps
    stats = core.stats()
    assert stats.prefix_cache_hit_tokens == 3 * 12
    assert stats.prompt_tokens == len(prompts[0]) + sum(len(p) - 12 for p in prompts[1:])
    for rid, prompt, _ in requests:
        assert_as_cold(got[rid], rid, prompt)
    core.close()

    core = make_core(checkpoint, kv_layout=layout, enable_prefix_caching=True)
    core.add_requests([EngineRequest(rid, tuple(p), params) for rid, p, params in requests])
    finished = {rid: Finished() for rid, _, _ in requests}
    for delta in core.step():  # c0 computes the first chunk of the context; the others wait
        finished[delta.request_id].add(delta)
    assert core.scheduler.running_request_ids() == ["c0"]
    assert core.abort_request("c0")
    while core.has_unfinished_requests():
        for delta in core.step():
            finished[delta.request_id].add(delta)
    assert core.leak_report() == []
    assert core.stats().prefix_cache_hit_tokens == 2 * 12  # c1 computed it, c2 and c3 reused
    for rid, prompt, _ in requests[1:]:
        assert_as_cold(finished[rid], rid, prompt)
    core.close()
