"""The engine reports which attention backend runs and whether decode is captured (R14), and an
explicit backend choice it cannot serve fails at configuration time naming every option."""

from __future__ import annotations

import pytest
from rlt import LLM
from rlt_attention import BACKENDS
from rlt_contracts import ConfigurationError


def test_stats_say_which_backend_runs_and_why_decode_is_eager(llm_factory):
    llm = llm_factory()  # cpu: graphs requested by default, impossible without CUDA
    stats = llm.get_stats()
    assert stats.attention_backend == "torch"
    assert not stats.decode_cuda_graphs
    assert "CUDA device" in stats.decode_eager_reason
    assert llm.engine.parts.attention_warning is None  # graphs are no requirement on the CPU
    eager = llm_factory(cuda_graphs=False).get_stats()
    assert (eager.decode_cuda_graphs, eager.decode_eager_reason) == (False, "not requested")


def test_flash_attn_by_name_at_the_default_block_size_names_backend_and_block_size(
    tiny_checkpoint,
):
    with pytest.raises(ConfigurationError) as info:
        LLM(tiny_checkpoint(), device="cpu", dtype="float32", attention_backend="flash_attn")
    options, message = info.value.options, info.value.message
    assert options[0] == "attention_backend" and "block_size" in options
    assert "block_size 16 is not a multiple of 256" in message and "block_size=256" in message
    if BACKENDS["flash_attn"].unavailable_reason() is not None:
        assert "flash-attn is not importable here" in message
