"""`SamplingBatch.build`: tensor layout, host flags, and row validation."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import SamplingParams, SamplingRow
from rlt_sampling import MIN_TEMPERATURE, SamplingBatch


def test_build_lays_out_one_row_per_request():
    rows = [
        SamplingRow(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**62), 3),
        SamplingRow(SamplingParams(seed=5, logprobs=2), 0),
    ]
    batch = SamplingBatch.build(rows, device="cpu")
    assert batch.temperature.dtype == torch.float32 and batch.top_p.dtype == torch.float32
    assert batch.top_k.dtype == batch.seed.dtype == batch.counter.dtype == torch.int64
    assert batch.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert batch.top_k.tolist() == [40, -1] and batch.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert batch.seed.tolist() == [2**62, 5] and batch.counter.tolist() == [3, 0]
    assert batch.num_rows == 2 and batch.device == torch.device("cpu")
    assert (batch.all_greedy, batch.any_top_k_top_p) == (False, True)
    assert batch.num_top_logprobs == 2 and batch.requested_logprobs == (None, 2)


@pytest.mark.parametrize(
    ("params", "all_greedy", "any_top_k_top_p"),
    [
        ([SamplingParams(), SamplingParams(top_k=5, top_p=0.5)], True, False),  # greedy ignores k/p
        ([SamplingParams(), SamplingParams(temperature=1.0)], False, False),
        ([SamplingParams(temperature=1.0, top_k=1)], False, True),
        ([SamplingParams(temperature=1.0, top_p=0.99)], False, True),
    ],
)
def test_host_flags_only_count_random_rows(params, all_greedy, any_top_k_top_p):
    batch = SamplingBatch.build([SamplingRow(p, 0) for p in params], device="cpu")
    assert (batch.all_greedy, batch.any_top_k_top_p) == (all_greedy, any_top_k_top_p)


@pytest.mark.parametrize(
    ("logprobs", "expected"), [((None, None), None), ((None, 0), 0), ((3, 0, None, 7), 7)]
)
def test_num_top_logprobs_is_the_largest_request(logprobs, expected):
    rows = [SamplingRow(SamplingParams(logprobs=n), 0) for n in logprobs]
    assert SamplingBatch.build(rows, device="cpu").num_top_logprobs == expected


def test_tiny_positive_temperature_stays_random_but_finite():
    batch = SamplingBatch.build([SamplingRow(SamplingParams(temperature=1e-40), 0)], "cpu")
    assert not batch.all_greedy
    assert batch.temperature.tolist() == [pytest.approx(MIN_TEMPERATURE)]


def test_empty_batch_is_all_greedy():
    batch = SamplingBatch.build([], device="cpu")
    assert batch.all_greedy and batch.num_rows == 0 and batch.num_top_logprobs is None


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (SamplingRow(SamplingParams(seed=None), 0), "resolved seed"),
        (SamplingRow(SamplingParams(), -1), "output_index"),
        (SamplingRow(SamplingParams(), True), "output_index"),
        (SamplingRow(SamplingParams(), 2**63), "output_index"),
    ],
)
def test_build_rejects_unresolved_seed_and_bad_output_index(row, message):
    with pytest.raises(ValueError, match=message):
        SamplingBatch.build([SamplingRow(SamplingParams(), 0), row], device="cpu")
