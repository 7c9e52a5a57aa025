"""The Triton tick kernels (prepare / commit / copy) equal the torch tick they replace: whole
generations through the engine with either implementation give identical tokens, depths and
logprobs, for every exit rule kind, every layout (ring:3 of 4 loops: plane (loop - 1) mod 3, the
fill of planes an early exit never wrote), cohort decoding, stops and logprobs. Without
CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest).
Engine-level (it drives `rlt.LLM`), so it lives with the workspace tests, not in rlt-runner's."""

from __future__ import annotations

import json

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_runner import tick_kernels

pytestmark = pytest.mark.skipif(not tick_kernels.available(), reason="triton is not installed")

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
        **options,
    )
    program = llm.engine.core.runner.program
    program.kernels = tick_kernels.TickKernels(program) if fused else None
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
    return [
        (o.token_ids, o.exit_depths, o.finish_reason, o.logprobs, o.top_logprobs) for o in outputs
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"kv_layout": "shared"},
        {"kv_layout": "ring:3"},
        {"scheduling_mode": "no_refill"},
        {"exit_policy": "ouro_delayed"},
    ],
    ids=["last_exited", "shared", "ring", "no_refill", "delayed"],
)
def test_fused_tick_equals_torch_tick(tiny_checkpoint, options):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    params = [
        SamplingParams(max_tokens=7, exit_threshold=0.55, ignore_eos=True),
        SamplingParams(max_tokens=6, exit_threshold=1.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, exit_threshold=0.7, temperature=0.8, seed=3, top_p=0.9),
        SamplingParams(max_tokens=5, min_loops=1, exit_threshold=0.3, stop_token_ids=(1, 2, 3)),
    ]
    reference = generate(path, False, params, **options)
    assert generate(path, True, params, **options) == reference
    assert any(d < 4 for tokens, depths, *_ in reference for d in depths[1:])


def test_fused_tick_replays_a_trace(tiny_checkpoint, tmp_path):
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
