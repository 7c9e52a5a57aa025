"""CUDA path: same noise and tokens as CPU, batch independence, and no host sync while sampling.

Marked `cuda`: skipped (with the reason) where no CUDA device is present.
"""

from __future__ import annotations

import pytest
import torch
from rlt_contracts import SamplingParams, SamplingRow
from rlt_sampling import Sampler, SamplingBatch, counter_gumbel, counter_uniform

pytestmark = pytest.mark.cuda

ROWS = [
    SamplingRow(SamplingParams(logprobs=3), 0),
    SamplingRow(SamplingParams(temperature=0.8, seed=1, logprobs=0), 5),
    SamplingRow(SamplingParams(temperature=1.1, top_k=40, seed=2**62 + 3), 17),
    SamplingRow(SamplingParams(temperature=0.6, top_p=0.9, seed=7, logprobs=5), 2**33),
    SamplingRow(SamplingParams(temperature=1.5, top_k=100, top_p=0.5, seed=11), 1),
]


def logits_for(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0)) * 3


def test_noise_matches_cpu():
    seeds = torch.tensor([0, 5, 2**63 - 1], dtype=torch.int64)
    counters = torch.tensor([0, 2**32 + 1, 9], dtype=torch.int64)
    cpu = counter_uniform(seeds, counters, 151_936)
    assert torch.equal(counter_uniform(seeds.cuda(), counters.cuda(), 151_936).cpu(), cpu)
    cuda_gumbel = counter_gumbel(seeds.cuda(), counters.cuda(), 151_936).cpu()
    gumbel_gap = cuda_gumbel - cpu.log().neg().log().neg()
    assert float(gumbel_gap.abs().max()) < 1e-5  # log() may differ by an ulp between devices


def test_tokens_and_logprobs_match_cpu():
    logits = logits_for(len(ROWS), 32_000).to(torch.bfloat16)
    cpu = Sampler().sample(logits, SamplingBatch.build(ROWS, "cpu"))
    cuda = Sampler().sample(logits.cuda(), SamplingBatch.build(ROWS, "cuda"))
    assert cuda.token_ids.device.type == "cuda"
    # Equal unless a Gumbel score or top-p boundary is within an ulp: not the case for this data.
    assert torch.equal(cuda.token_ids.cpu(), cpu.token_ids)
    assert float((cuda.logprobs.cpu() - cpu.logprobs).abs().max()) < 1e-4
    assert [row.token_id for row in cuda.to_host()] == cpu.token_ids.tolist()


def test_rows_are_independent_of_batch_composition_on_cuda():
    logits = logits_for(len(ROWS), 32_000).cuda()
    together = Sampler().sample(logits, SamplingBatch.build(ROWS, "cuda")).token_ids
    for index, row in enumerate(ROWS):
        alone = Sampler().sample(logits[index : index + 1], SamplingBatch.build([row], "cuda"))
        assert torch.equal(alone.token_ids, together[index : index + 1])


def test_sampling_never_synchronizes_with_the_host():
    logits = logits_for(len(ROWS), 32_000).cuda()
    batch = SamplingBatch.build(ROWS, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit device->host sync raises
    try:
        output = Sampler().sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert output.token_ids.shape == (len(ROWS),)


@pytest.mark.slow  # ~18 s of torch.compile on an H200
def test_compiled_noise_gives_the_same_tokens_as_eager():
    eager, compiled = Sampler(), Sampler(compile_noise=True)
    for num_rows in (len(ROWS), 2):  # a second shape exercises the dynamic-shape graph
        logits = logits_for(num_rows, 32_000).cuda()
        batch = SamplingBatch.build(ROWS[-num_rows:], "cuda")
        assert torch.equal(
            compiled.sample(logits, batch).token_ids, eager.sample(logits, batch).token_ids
        )
