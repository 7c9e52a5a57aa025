"""Prompt scoring at full depth (issue 25, `SamplingParams.prompt_logprobs`), tiny fp32 models on
the CPU: every prompt token's log-probability and top alternatives equal the independent fp64
oracle's in both KV layouts (LAST_EXITED: the Hugging Face forward; SHARED: its position-by-
position prefill), whatever the chunking; a scored prompt skips the prefix cache and scores
the same as a cold one; other requests in the same steps are unchanged; nothing leaks."""

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


def test_scoring_changes_no_generated_token_and_skips_the_prefix_cache(checkpoint):
    plain = SamplingParams(max_tokens=3, exit_threshold=0.6, ignore_eos=True)
    cold = LLM(checkpoint, **ENGINE)
    reference = cold.generate(PROMPTS, [scored(0)] * len(PROMPTS))
    cold.shutdown()
    llm = LLM(checkpoint, **ENGINE, enable_prefix_caching=True)
    llm.generate(PROMPTS[:1], plain)  # publishes the first prompt's pages
    hits_before = llm.get_stats().prefix_cache_hit_tokens
    mixed = llm.generate(PROMPTS, [scored(0), plain, scored(0)])
    assert llm.get_stats().prefix_cache_hit_tokens == hits_before  # the scored prompt missed
    assert mixed[0].prompt_logprobs == reference[0].prompt_logprobs
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
