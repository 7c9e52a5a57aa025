"""The Triton bookkeeping of speculative rounds (rlt_runner.speculative_kernels) equals the torch
code it replaces: whole generations with speculation give identical tokens, exit depths, finish
reasons and logprobs with either implementation, for every exit rule kind, both KV layouts, mid-
token rounds (no_refill), sampled rows and stops. Without CUDA the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set by the root conftest). Engine-level (it drives `rlt.LLM`),
so it lives with the workspace tests."""

from __future__ import annotations

import json

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_runner import speculative_kernels
from rlt_runner.loop_bookkeeping import TorchBookkeeping

pytestmark = pytest.mark.skipif(
    not speculative_kernels.available(), reason="triton is not installed"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 200, 3, 99], [250, 11], [64, 128, 9, 31, 77, 18, 200], [7]]


def generate(path, fused: bool, params, **options):
    llm = LLM(
        path,
        dtype="float32",
        device=DEVICE,
        block_size=4,
        num_kv_blocks=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        prefill_chunk_size=5,
        cuda_graphs=False,
        num_speculative_tokens=3,
        speculative_draft_loops=options.pop("draft_loops", 1),
        **options,
    )
    program = llm.engine.core.runner.speculation
    program.bookkeeping = (
        speculative_kernels.SpeculativeKernels(program)
        if fused
        else TorchBookkeeping(program.position_loops)
    )
    outputs = llm.generate(PROMPTS, params)
    stats = llm.engine.core.stats()
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
    assert stats.spec_accepted_tokens > 0  # rounds ran and kept drafts
    return [
        (o.token_ids, o.exit_depths, o.finish_reason, o.logprobs, o.top_logprobs) for o in outputs
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_layout": "shared"},
        {"scheduling_mode": "no_refill", "draft_loops": 2},
        {"exit_policy": "ouro_delayed", "draft_loops": 2},
    ],
    ids=["last_exited", "shared", "no_refill", "delayed"],
)
def test_fused_round_bookkeeping_equals_torch(tiny_checkpoint, options):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    params = [
        SamplingParams(max_tokens=7, exit_threshold=0.55, ignore_eos=True),
        SamplingParams(max_tokens=6, exit_threshold=1.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, exit_threshold=0.7, temperature=0.8, seed=3, top_p=0.9),
        SamplingParams(max_tokens=5, min_loops=1, exit_threshold=0.3, stop_token_ids=(1, 2, 3)),
    ]
    reference = generate(path, False, params, **dict(options))
    assert generate(path, True, params, **dict(options)) == reference
    assert any(d < 4 for tokens, depths, *_ in reference for d in depths[1:])


def test_fused_round_bookkeeping_replays_a_trace(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    trace = tmp_path / "trace.json"
    trace.write_text(
        json.dumps({f"generate-{i}": [4, 2, 3, 1, 4, 2, 2][: 6 + i % 2] for i in range(4)})
    )
    params = SamplingParams(max_tokens=6, min_loops=1, ignore_eos=True)
    options = {"exit_policy": "trace", "exit_trace": str(trace)}
    reference = generate(path, False, params, **options)
    assert generate(path, True, params, **options) == reference
    assert [depths for _, depths, *_ in reference] == [[4, 2, 3, 1, 4, 2]] * 4
