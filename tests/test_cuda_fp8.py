"""fp8 weights and the fp8 KV cache in the engine on CUDA (skipped without a GPU): whole engine
steps with both (prefill, decode ticks under CUDA graphs with early exits and LAST_EXITED
finalization copies of fp8 bytes, preemption snapshots and restores, prefix-cache hits) make no
host-device sync besides the one read-back per step, in both layouts and in bf16; the pool holds
one byte per cached element."""

from __future__ import annotations

import pytest
from test_cuda_engine import scenario_without_sync

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp8_engine_steps_make_no_host_sync_but_the_read_back(llm_factory, layout):
    llm = llm_factory(
        device="cuda",
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype="fp8",
        kv_layout=layout,
        num_kv_blocks=40 if layout == "last_exited" else 16,
        incremental_kv=True,
        enable_preemption=True,
        enable_prefix_caching=layout == "last_exited",
    )
    runner = llm.engine.core.runner
    assert llm.engine.parts.attention_backend == "triton" and runner.graphs is not None
    assert runner.kv.tensors.key_cache.element_size() == 1
    stats = scenario_without_sync(llm)
    assert stats.preemptions > 0 and stats.generation_tokens > 0
    assert llm.engine.model_info().kv_cache_dtype == "float8_e4m3fn"
