"""Prompt scoring at full depth (issue 25, `SamplingParams.prompt_logprobs`), tiny fp32 models on
the CPU: every prompt token's log-probability and top alternatives equal the independent fp64
oracle's in both KV layouts (LAST_EXITED: the Hugging Face forward; SHARED: its position-by-
position prefill), whatever the chunking; a scored prompt reuses only cached pages that carry
scores (a plain prompt's pages carry none), and the choices of a multiple-choice question
compute their shared context once and score as cold ones do; other requests in the same steps
are unchanged; nothing leaks."""

from __future__ import annotations

import math

import pytest
from oracle.dense_ouro import DenseOuro
from oracle.generation import GenerationOracle
from rlt import LLM, SamplingParams

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11], [250, 11], [64, 128, 9, 31, 77, 18]]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


def scored(top: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=3, prompt_logprobs=top, exit_threshold=0.6, ignore_eos=True)


@pytest.mark.parametrize("chunk", [3, 16])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_prompt_logprobs_equal_the_oracle(checkpoint, layout, chunk, monkeypatch):
    from rlt_runner import prompt_scoring

    monkeypatch.setattr(prompt_scoring, "SLICE_ROWS", 4)  # chunks of 16 span several slices
    llm = LLM(checkpoint, **ENGINE, kv_layout=layout, prefill_chunk_size=chunk)
    outputs = llm.generate(PROMPTS, [scored()] * len(PROMPTS))
    assert llm.engine.core.leak_report() == []
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want = oracle.prompt_logprobs(tuple(prompt))
        assert output.prompt_logprobs[0] is None and output.prompt_top_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        # fp32 engine against the fp64 oracle: 1e-4 on log-probabilities of magnitude ~6
        assert output.prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
        for top in output.prompt_top_logprobs[1:]:
            assert len(top) == 2 and top[0][1] >= top[1][1]
            assert all(math.isfinite(lp) and lp <= 0 for _, lp in top)
    llm.shutdown()


def test_scoring_changes_no_generated_token_and_takes_no_pages_without_scores(checkpoint):
    plain = SamplingParams(max_tokens=3, exit_threshold=0.6, ignore_eos=True)
    cold = LLM(checkpoint, **ENGINE)
    reference = cold.generate(PROMPTS, [scored(0)] * len(PROMPTS))
    cold.shutdown()
    llm = LLM(checkpoint, **ENGINE, enable_prefix_caching=True)
    llm.generate(PROMPTS[:1], plain)  # publishes the first prompt's pages
    hits_before = llm.get_stats().prefix_cache_hit_tokens
    mixed = llm.generate(PROMPTS, [scored(0), plain, scored(0)])
    # the plain prompt's pages carry no scores: the scored prompt computes them itself
    assert llm.get_stats().prefix_cache_hit_tokens == hits_before
    # computed in another batch (a plain row instead of a scored one): equal to fp32 rounding
    assert_same_scores(mixed[0], reference[0])
    assert mixed[1].prompt_logprobs is None
    assert [o.token_ids for o in mixed] == [o.token_ids for o in reference]
    assert llm.engine.core.leak_report() == []
    llm.shutdown()


def test_scoring_through_a_prefill_decode_pair_is_refused(checkpoint):
    """The prompt is computed on the prefill instance, which reports no scores: a clear error,
    not a response without them."""
    from rlt_contracts import InvalidRequestError, KVTransferParams, PDRole

    llm = LLM(checkpoint, **ENGINE)
    transfer = KVTransferParams(PDRole.DECODE, "t0", prefill_agent="P")
    with pytest.raises(InvalidRequestError, match="prefill/decode") as error:
        llm.engine.add_request("r", PROMPTS[0], scored(), kv_transfer=transfer)
    assert error.value.field == "prompt_logprobs"
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()


CONTEXT = [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 64, 128]  # 13 tokens: 3 full pages of 4
CHOICES = [[31, 77], [18], [250, 11, 9], [42, 42]]


# Scores of the same positions computed in different batches or chunks: without
# --batch-invariant the CPU GEMMs may block their reductions differently for another number of
# rows (AVX-512 kernels do), so the fp32 logits differ in the last bits; the log-probabilities
# here are about -5, where one fp32 ulp is 4.8e-7 (5e-7 apart was seen on an AVX-512 Xeon).
# 1e-5 allows ~20 ulps of rounding and still fails a score of a wrong position or record.
# Bitwise equality is checked only where the values are the same records (prefix-cache hits).
REBATCHED_ABS = 1e-5


def assert_same_scores(got, want, *, top: int | None = None) -> None:
    """The same prompt's scores from two engines or batches (REBATCHED_ABS); `top`: the first
    `top` alternatives of `want`'s."""
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
    assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=REBATCHED_ABS)
    assert got.prompt_token_ranks == want.prompt_token_ranks
    for alternatives, expected in zip(
        got.prompt_top_logprobs[1:], want.prompt_top_logprobs[1:], strict=True
    ):
        expected = expected[:top]
        assert [t for t, _ in alternatives] == [t for t, _ in expected]
        assert [lp for _, lp in alternatives] == pytest.approx(
            [lp for _, lp in expected], abs=REBATCHED_ABS
        )


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_the_choices_of_a_question_compute_their_shared_context_once(checkpoint, layout):
    """4 choices after one 13-token context (block 4): the first computes the context and
    publishes its 3 full pages with their scores; the other 3 (in one batch) take the pages and
    their scores and compute only from position 12. Every choice scores as without a cache (and
    as the fp64 oracle); a request wanting more alternatives than the records hold computes
    its prompt, and its records then serve such requests."""
    prompts = [CONTEXT + choice for choice in CHOICES]
    cold = LLM(checkpoint, **ENGINE, kv_layout=layout)
    reference = [cold.generate([p], scored())[0] for p in prompts]
    assert cold.engine.core.leak_report() == []
    cold.shutdown()
    llm = LLM(checkpoint, **ENGINE, kv_layout=layout, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], scored())
    stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens == 0 and stats.prompt_tokens == len(prompts[0])
    rest = llm.generate(prompts[1:], [scored()] * 3)
    stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens == 3 * 12  # the context's 3 full pages, per choice
    # the context once, then each choice from position 12
    assert stats.prompt_tokens == len(prompts[0]) + sum(len(p) - 12 for p in prompts[1:])
    assert llm.engine.core.leak_report() == []
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)
    for prompt, got, want in zip(prompts, first + rest, reference, strict=True):
        assert_same_scores(got, want)
        assert got.token_ids == want.token_ids
        assert got.prompt_logprobs[1:] == pytest.approx(
            oracle.prompt_logprobs(tuple(prompt))[1:], abs=1e-4
        )
    fewer = llm.generate(prompts[:1], scored(1))[0]  # the records' first alternative
    assert llm.get_stats().prefix_cache_hit_tokens == 4 * 12
    # the reused pages' scores (positions 1-12, from the hidden states of positions 0-11) are
    # the records: exact; the positions computed after them, in another chunk than the first
    # time, agree to fp32 rounding (REBATCHED_ABS)
    records = [top[:1] for top in first[0].prompt_top_logprobs[1:13]]
    assert fewer.prompt_top_logprobs[1:13] == records
    assert fewer.prompt_logprobs[:13] == first[0].prompt_logprobs[:13]
    assert_same_scores(fewer, first[0], top=1)
    assert_same_scores(fewer, reference[0], top=1)
    more = llm.generate(prompts[:1], scored(3))[0]  # records hold 2: no hit
    assert llm.get_stats().prefix_cache_hit_tokens == 4 * 12
    again = llm.generate(prompts[:1], scored(3))[0]  # the wider records replaced them
    assert llm.get_stats().prefix_cache_hit_tokens == 5 * 12
    assert again.prompt_logprobs[:13] == more.prompt_logprobs[:13]
    assert again.prompt_top_logprobs[:13] == more.prompt_top_logprobs[:13]
    assert_same_scores(again, more)
    assert llm.engine.core.leak_report() == []
    llm.shutdown()


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_choices_submitted_together_compute_their_context_once(checkpoint, layout):
    """The 4 choices in one call (as one list-of-prompts completion sends them), before any
    has published the context: the first computes it, the other 3 wait until its 3 pages are
    read back (rlt-scheduler's prefix waits) and take them with their scores. Scores and tokens
    equal the cold engine's and the oracle's. Plain prompts sharing the running scored prompt's
    pages (prefill's KV at full depth) wait for them the same way."""
    prompts = [CONTEXT + choice for choice in CHOICES]
    plain = SamplingParams(max_tokens=3, exit_threshold=0.6, ignore_eos=True)
    cold = LLM(checkpoint, **ENGINE, kv_layout=layout)
    reference = cold.generate(prompts, [scored()] * 4)
    plain_reference = cold.generate(prompts[1:], plain)
    assert cold.engine.core.leak_report() == []
    cold.shutdown()
    llm = LLM(checkpoint, **ENGINE, kv_layout=layout, enable_prefix_caching=True)
    got = llm.generate(prompts, [scored()] * 4)
    stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens == 3 * 12  # the context's 3 full pages, per choice
    assert stats.prompt_tokens == len(prompts[0]) + sum(len(p) - 12 for p in prompts[1:])
    assert llm.engine.core.leak_report() == []
    oracle = GenerationOracle(DenseOuro(checkpoint), layout)
    for prompt, output, want in zip(prompts, got, reference, strict=True):
        assert_same_scores(output, want)
        assert output.token_ids == want.token_ids
        assert output.prompt_logprobs[1:] == pytest.approx(
            oracle.prompt_logprobs(tuple(prompt))[1:], abs=1e-4
        )
    llm.shutdown()
    llm = LLM(checkpoint, **ENGINE, kv_layout=layout, enable_prefix_caching=True)
    mixed = llm.generate(prompts, [scored(), plain, plain, plain])
    assert llm.get_stats().prefix_cache_hit_tokens == 3 * 12
    assert_same_scores(mixed[0], reference[0])
    assert [o.token_ids for o in mixed[1:]] == [o.token_ids for o in plain_reference]
    assert all(o.prompt_logprobs is None for o in mixed[1:])
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
