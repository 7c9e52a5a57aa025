"""Penalties, logit_bias, min_tokens and min_p against a literal float64 reference of vLLM's rules.

The reference below is written token by token from the rules (SamplingParams' docstring), in
float64, sharing no code with `rlt_sampling`: min_tokens mask, logit_bias, repetition,
frequency, presence (raw logits), then temperature, then min_p. fp32 results must agree to
~1e-5 relative; token comparisons are only made where the reference's decision margin exceeds
1e-3, far above fp32 rounding.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from rlt_contracts import LogitsAdjustments, SamplingMode, SamplingParams, SamplingRow
from rlt_sampling import Sampler, SamplingBatch, adjust_logits, counter_gumbel

V = 64
INF = float("inf")


def reference_adjusted(logits_row, params, prompt, outputs, stop_ids) -> list[float]:
    x = [float(v) for v in logits_row.double()]
    if len(outputs) < params.min_tokens:
        for token in stop_ids:
            x[token] = -INF
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    counts = Counter(outputs)
    r, f, p = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    for v in range(len(x)):
        if v in prompt or counts[v] > 0:
            x[v] = x[v] / r if x[v] > 0 else x[v] * r
        x[v] -= f * counts[v] + p * (1 if counts[v] > 0 else 0)
    return x


def reference_min_p(scaled: list[float], min_p: float) -> list[float]:
    top = max(scaled)
    weights = [math.exp(v - top) if v > -INF else 0.0 for v in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    largest = max(probs)
    return [v if prob >= min_p * largest else -INF for v, prob in zip(scaled, probs, strict=True)]


def history(n: int, gen: torch.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompt = tuple(torch.randint(0, V, (5 + n % 3,), generator=gen).tolist())
    outputs = tuple(torch.randint(0, V // 2, (n,), generator=gen).tolist())  # repeats likely
    return prompt, outputs


PARAMS = [
    SamplingParams(max_tokens=50),  # neutral
    SamplingParams(max_tokens=50, repetition_penalty=1.7),
    SamplingParams(max_tokens=50, repetition_penalty=0.6),
    SamplingParams(max_tokens=50, frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(max_tokens=50, presence_penalty=2.0, frequency_penalty=-2.0),
    SamplingParams(max_tokens=50, logit_bias={3: 5.5, 40: -7.25, 0: 1.0}),
    SamplingParams(max_tokens=50, min_tokens=14, stop_token_ids=(1, 2)),
    SamplingParams(
        max_tokens=50,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={7: 3.0, 1: 50.0},
        min_tokens=20,
        stop_token_ids=(1,),
    ),
]


def rows_and_logits(seed: int = 0, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, params in enumerate(PARAMS):
        prompt, outputs = history(n * 2 + 1, gen)
        rows.append(
            SamplingRow(
                params, len(outputs), prompt, outputs, stop_token_ids=(*params.stop_token_ids, 0)
            )
        )
    logits = torch.randn(len(rows), V, generator=gen) * scale
    return rows, logits


def reference_of(row: SamplingRow, logits_row) -> list[float]:
    return reference_adjusted(
        logits_row, row.params, set(row.prompt_token_ids), row.output_token_ids, row.stop_token_ids
    )


def test_adjusted_logits_match_the_float64_reference():
    rows, logits = rows_and_logits()
    batch = SamplingBatch.build(rows, "cpu", vocab_size=V)
    assert batch.penalized and batch.biased and batch.min_tokens
    adjusted = adjust_logits(
        logits, batch.adjustments, counter=batch.counter, mode=batch.adjustment_mode
    )
    assert adjusted.dtype == torch.float32
    for n, row in enumerate(rows):
        expected = torch.tensor(reference_of(row, logits[n]), dtype=torch.float64)
        got = adjusted[n].double()
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), n
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-5), n
    # the cases really change something (the test would be vacuous otherwise)
    for n in range(1, len(rows)):
        assert not torch.equal(adjusted[n], logits[n]), n


def test_neutral_rows_are_bitwise_unchanged_and_sample_as_without_adjustments():
    rows, logits = rows_and_logits(seed=1)
    mixed = [with_params(r, temperature=0.8, seed=5) for r in rows]
    neutral = [SamplingRow(mixed[0].params, mixed[0].output_index)]  # no history at all
    sampler = Sampler()
    batch = SamplingBatch.build(mixed, "cpu", vocab_size=V)
    adjusted = adjust_logits(
        logits, batch.adjustments, counter=batch.counter, mode=batch.adjustment_mode
    )
    assert torch.equal(adjusted[0], logits[0])
    alone = sampler.sample(logits[:1], neutral).token_ids
    together = sampler.sample(logits, mixed).token_ids
    assert together[0] == alone[0]


def structs_replace(params: SamplingParams, **changes) -> SamplingParams:
    """A copy with `changes` (built again, so it is validated again)."""
    fields = {name: getattr(params, name) for name in params.__struct_fields__}
    return SamplingParams(**{**fields, **changes})


def with_params(row: SamplingRow, **changes) -> SamplingRow:
    return SamplingRow(
        structs_replace(row.params, **changes),
        row.output_index,
        row.prompt_token_ids,
        row.output_token_ids,
        row.stop_token_ids,
    )


def gumbel_reference_token(scores: list[float], seed: int, counter: int) -> tuple[int, float]:
    """argmax(scores + Gumbel(seed, counter)) in float64, and the gap to the runner-up."""
    noise = counter_gumbel(torch.tensor([seed]), torch.tensor([counter]), len(scores))[0].double()
    totals = [s + float(g) if s > -INF else -INF for s, g in zip(scores, noise, strict=True)]
    order = sorted(range(len(totals)), key=lambda v: -totals[v])
    return order[0], totals[order[0]] - totals[order[1]]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_tokens_match_the_reference_greedy_and_random(temperature, min_p):
    checked = 0
    for seed in range(6):
        rows, logits = rows_and_logits(seed=seed, scale=2.0)
        rows = [with_params(r, temperature=temperature, min_p=min_p, seed=seed + 11) for r in rows]
        tokens = Sampler().sample(logits, rows).token_ids.tolist()
        for n, row in enumerate(rows):
            adjusted = reference_of(row, logits[n])
            if temperature == 0.0:
                order = sorted(range(V), key=lambda v: -adjusted[v])
                expected, margin = order[0], adjusted[order[0]] - adjusted[order[1]]
            else:
                scaled = [v / temperature for v in adjusted]
                scaled = reference_min_p(scaled, min_p) if min_p > 0 else scaled
                expected, margin = gumbel_reference_token(scaled, seed + 11, row.output_index)
            if margin > 1e-3:
                assert tokens[n] == expected, (seed, n)
                checked += 1
    assert checked >= 40


def test_min_p_drops_exactly_the_tokens_under_the_threshold():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -1.0, 3.9]])
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=2)
    probs = torch.softmax(logits[0].double(), -1)
    kept = {v for v in range(6) if probs[v] >= 0.3 * probs.max()}
    assert kept == {0, 1, 5}
    drawn = Sampler().sample(logits.expand(3000, -1), [SamplingRow(params, c) for c in range(3000)])
    counts = Counter(drawn.token_ids.tolist())
    assert set(counts) == kept
    renormalised = {v: float(probs[v]) / sum(float(probs[k]) for k in kept) for v in kept}
    for v in kept:  # binomial z-score
        p = renormalised[v]
        z = (counts[v] - 3000 * p) / math.sqrt(3000 * p * (1 - p))
        assert abs(z) < 4.5, (v, z)


def test_min_tokens_masks_stop_ids_only_before_min_tokens():
    logits = torch.zeros(4, V)
    logits[:, 2] = 10.0  # the stop id is by far the most likely
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(2,), logit_bias={2: 100.0})
    rows = [SamplingRow(params, i, output_token_ids=(5,) * i) for i in range(4)]
    tokens = Sampler().sample(logits, rows).token_ids.tolist()
    assert [t == 2 for t in tokens] == [False, False, False, True]
    random = [SamplingRow(structs_replace(params, temperature=1.0), i) for i in range(3)]
    for _ in range(3):
        assert 2 not in Sampler().sample(logits[:3], random).token_ids.tolist()


def test_min_tokens_mask_survives_every_later_step():
    """-inf stays -inf: a positive bias, a negative frequency penalty or a repetition penalty
    below 1 cannot bring back a masked stop id."""
    logits = torch.zeros(1, V)
    params = SamplingParams(
        max_tokens=10,
        min_tokens=5,
        stop_token_ids=(9,),
        logit_bias={9: 100.0},
        frequency_penalty=-2.0,
        repetition_penalty=0.5,
    )
    row = SamplingRow(params, 2, prompt_token_ids=(9,), output_token_ids=(9, 9))
    batch = SamplingBatch.build([row], "cpu", vocab_size=V)
    adjusted = adjust_logits(
        logits, batch.adjustments, counter=batch.counter, mode=batch.adjustment_mode
    )
    assert adjusted[0, 9] == -INF and torch.isfinite(adjusted[0, :9]).all()


def test_logit_bias_of_100_forces_a_token():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4)) * 3
    greedy = SamplingParams(logit_bias={33: 100.0})
    random = SamplingParams(temperature=1.0, seed=8, logit_bias={33: 100.0})
    for counter in range(20):
        rows = [SamplingRow(greedy, 0), SamplingRow(random, counter)]
        assert Sampler().sample(logits, rows).token_ids.tolist() == [33, 33]


def test_logprobs_stay_those_of_the_raw_logits():
    rows, logits = rows_and_logits(seed=3)
    rows = [with_params(r, logprobs=3) for r in rows]
    output = Sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(output.logprobs, raw.gather(1, output.token_ids[:, None]).squeeze(1))
    assert torch.equal(output.top_logprobs, torch.topk(raw, 3, dim=-1).values)


def test_sample_rows_with_device_state_equals_sample_of_rows():
    """The TokenSampler entry (the runner's persistent-row form) samples the same tokens."""
    rows, logits = rows_and_logits(seed=5)
    rows = [with_params(r, temperature=0.9, min_p=0.1, top_k=20, seed=7) for r in rows]
    batch = SamplingBatch.build(rows, "cpu", vocab_size=V)
    mode = SamplingMode(
        random=True, filtered=True, penalized=True, biased=True, min_tokens=True, min_p=True
    )
    adjustments = batch.adjustments
    assert isinstance(adjustments, LogitsAdjustments)
    via_rows = Sampler().sample_rows(
        logits,
        temperature=batch.temperature,
        top_k=batch.top_k,
        top_p=batch.top_p,
        seed=batch.seed,
        counter=batch.counter,
        mode=mode,
        min_p=batch.min_p,
        adjustments=adjustments,
    )
    assert torch.equal(via_rows.token_ids, Sampler().sample(logits, rows).token_ids)
    with pytest.raises(ValueError, match="adjustments"):
        Sampler().sample_rows(
            logits,
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            seed=batch.seed,
            counter=batch.counter,
            mode=mode,
            min_p=batch.min_p,
        )


def test_build_checks_the_token_history():
    params = SamplingParams(frequency_penalty=1.0)
    with pytest.raises(ValueError, match="output ids"):
        SamplingBatch.build([SamplingRow(params, 2, (), (1,))], "cpu", vocab_size=V)
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingBatch.build([SamplingRow(params, 1, (V,), (1,))], "cpu", vocab_size=V)
    with pytest.raises(ValueError, match="vocabulary size"):
        SamplingBatch.build([SamplingRow(params, 0)], "cpu")
    biased = SamplingParams(logit_bias={V + 3: 1.0})
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler().sample(torch.zeros(1, V), [SamplingRow(biased, 0)])


def test_bf16_logits_are_adjusted_in_fp32():
    rows, logits = rows_and_logits(seed=6)
    low = logits.to(torch.bfloat16)
    batch = SamplingBatch.build(rows, "cpu", vocab_size=V)
    adjusted = adjust_logits(
        low, batch.adjustments, counter=batch.counter, mode=batch.adjustment_mode
    )
    assert adjusted.dtype == torch.float32
    for n, row in enumerate(rows):
        expected = torch.tensor(reference_of(row, low[n].float()), dtype=torch.float64)
        finite = torch.isfinite(expected)
        assert torch.allclose(adjusted[n].double()[finite], expected[finite], rtol=1e-6, atol=1e-5)
