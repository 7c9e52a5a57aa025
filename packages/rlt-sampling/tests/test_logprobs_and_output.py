"""Logprobs of the raw logits, top alternatives, low-precision logits, and the host read-back."""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import SamplingParams, SamplingRow
from rlt_sampling import HostSample, Sampler, SamplingBatch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """Max absolute difference check (torch.testing.assert_close costs seconds on first use).
    atol 1e-5: fp32 log_softmax over <= 64 logits of magnitude <= ~15 is good to ~1e-6."""
    assert actual.shape == expected.shape
    assert float((actual.double() - expected.double()).abs().max()) <= atol


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler().sample(logits, SamplingBatch.build(rows, device=logits.device))


def test_logprobs_are_log_softmax_of_raw_logits_with_sorted_alternatives():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        SamplingRow(SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs=5), 0),
        SamplingRow(SamplingParams(logprobs=5), 0),
        SamplingRow(SamplingParams(temperature=2.0, top_p=0.5, seed=2, logprobs=5), 7),
    ]
    output = run(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)  # before temperature / top-k / top-p
    chosen = reference.gather(1, output.token_ids[:, None]).squeeze(1)
    assert output.logprobs.dtype == torch.float32
    assert_close(output.logprobs, chosen, atol=1e-5)
    assert output.top_token_ids.shape == output.top_logprobs.shape == (3, 5)
    assert torch.equal(output.top_token_ids, reference.argsort(dim=-1, descending=True)[:, :5])
    assert bool((output.top_logprobs[:, :-1] >= output.top_logprobs[:, 1:]).all())
    assert_close(output.top_logprobs, reference.gather(1, output.top_token_ids), atol=1e-5)


def test_no_logprob_request_returns_no_logprob_tensors():
    output = run(torch.randn(2, 10), [SamplingRow(SamplingParams(), 0)] * 2)
    assert output.logprobs is None and output.top_token_ids is None
    assert output.to_host()[0].logprob is None


def test_to_host_trims_each_row_to_its_own_request():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    rows = [SamplingRow(SamplingParams(logprobs=n), 0) for n in (None, 0, 4)]
    output = run(logits, rows)
    host = output.to_host()
    assert all(isinstance(row, HostSample) for row in host)
    assert [row.token_id for row in host] == logits.argmax(dim=-1).tolist()
    assert host[0] == HostSample(host[0].token_id, None, ())
    assert host[1].logprob == output.logprobs[1].item() and host[1].top_logprobs == ()
    expected_top = tuple(
        zip(output.top_token_ids[2].tolist(), output.top_logprobs[2].tolist(), strict=True)
    )
    assert host[2].top_logprobs == expected_top and len(expected_top) == 4
    assert all(isinstance(token, int) for token, _ in host[2].top_logprobs)


def test_alternatives_are_capped_at_the_vocabulary_size():
    output = run(torch.randn(1, 3), [SamplingRow(SamplingParams(logprobs=20), 0)])
    assert output.top_token_ids.shape == (1, 3)
    assert len(output.to_host()[0].top_logprobs) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_accepted(dtype):
    logits = (torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    rows = [
        SamplingRow(SamplingParams(logprobs=2), 0),
        SamplingRow(SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=1, logprobs=2), 3),
        SamplingRow(SamplingParams(temperature=1.0, seed=2, logprobs=2), 3),
        SamplingRow(SamplingParams(temperature=1.0, top_k=1, seed=3, logprobs=2), 3),
    ]
    output = run(logits, rows)
    fp32_output = run(logits.float(), rows)  # the sampler upcasts exactly, so results agree
    assert torch.equal(output.token_ids, fp32_output.token_ids)
    greedy = logits.float().argmax(dim=-1)
    assert output.token_ids[0] == greedy[0] and output.token_ids[3] == greedy[3]  # top_k = 1
    assert output.logprobs.dtype == output.top_logprobs.dtype == torch.float32
    reference = torch.log_softmax(logits.double(), -1).gather(1, output.token_ids[:, None])
    assert_close(output.logprobs, reference.squeeze(1), atol=1e-5)


def test_logits_are_not_modified():
    logits = torch.randn(2, 20)
    before = logits.clone()
    rows = [SamplingRow(SamplingParams(temperature=0.5, top_k=3, top_p=0.5, logprobs=1), 0)] * 2
    run(logits, rows)
    assert torch.equal(logits, before)


def test_empty_batch_and_shape_mismatch():
    empty = run(torch.empty(0, 10), [])
    assert empty.token_ids.shape == (0,) and empty.to_host() == []
    with pytest.raises(ValueError, match="logits must be"):
        run(torch.randn(3, 10), [SamplingRow(SamplingParams(), 0)] * 2)
