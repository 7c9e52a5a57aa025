"""Backend selection: capability checks, reported reasons, and no silent switching (R13, R14)."""

from __future__ import annotations

import pytest
from rlt_attention import (
    BACKENDS,
    FLASH_ATTN_CAPABILITIES,
    TORCH_CAPABILITIES,
    TRITON_CAPABILITIES,
    BackendEntry,
    FlashAttnBackend,
    TorchPagedAttention,
    TritonPagedAttention,
    known_backends,
    select_attention_backend,
)
from rlt_contracts import AttentionRequirements, ConfigurationError, KVLayout


def requirements(**overrides) -> AttentionRequirements:
    fields = dict(
        device_type="cpu",
        dtype="float32",
        head_dim=64,
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        kv_layout=KVLayout.LAST_EXITED,
    )
    return AttentionRequirements(**(fields | overrides))


def flash_attn_importable() -> bool:
    return BACKENDS["flash_attn"].unavailable_reason() is None


def test_registry_names():
    assert known_backends() == ("torch", "triton", "flash_attn")


def test_auto_on_cpu_selects_torch_and_says_why_triton_was_rejected():
    selection = select_attention_backend(requirements())
    assert selection.name == "torch" and isinstance(selection.backend, TorchPagedAttention)
    assert "auto" in selection.reason and "triton" in selection.reason
    assert any("device 'cpu'" in reason for reason in selection.rejected["triton"])
    assert set(selection.rejected) == {"triton", "flash_attn"}


def test_auto_on_cuda_prefers_triton():
    selection = select_attention_backend(requirements(device_type="cuda", dtype="bfloat16"))
    assert selection.name == "triton" and isinstance(selection.backend, TritonPagedAttention)
    assert selection.rejected["torch"] == ["compatible, but 'triton' comes first in the auto order"]


def test_capture_capability_is_declared_per_backend():
    assert TRITON_CAPABILITIES.supports_cuda_graphs
    assert not TORCH_CAPABILITIES.supports_cuda_graphs
    assert not FLASH_ATTN_CAPABILITIES.supports_cuda_graphs


def test_auto_with_cuda_graphs_prefers_a_capturable_backend():
    selection = select_attention_backend(requirements(device_type="cuda", cuda_graphs=True))
    assert selection.name == "triton" and selection.cuda_graphs and selection.warning is None
    assert "can be captured" in selection.reason
    assert selection.rejected["torch"] == [
        "compatible, but cannot be captured as CUDA graphs and 'triton' can"
    ]


def test_auto_without_graphs_reports_no_capture_and_no_warning():
    selection = select_attention_backend(requirements(device_type="cuda"))
    assert selection.name == "triton" and not selection.cuda_graphs and selection.warning is None


def test_auto_with_graphs_but_no_capturable_backend_runs_eagerly_and_says_so(monkeypatch):
    absent = BackendEntry(
        "triton", TRITON_CAPABILITIES, lambda: "triton not importable (test)", TritonPagedAttention
    )
    monkeypatch.setitem(BACKENDS, "triton", absent)
    selection = select_attention_backend(requirements(device_type="cuda", cuda_graphs=True))
    assert selection.name == "torch" and not selection.cuda_graphs
    assert "decode ticks run eagerly" in selection.warning
    assert "triton not importable (test)" in selection.warning


def test_explicit_non_capturable_choice_is_honoured_with_a_warning():
    selection = select_attention_backend(
        requirements(device_type="cuda", dtype="bfloat16", cuda_graphs=True), "torch"
    )
    assert selection.name == "torch" and not selection.cuda_graphs
    assert "requested by name" in selection.warning and "run eagerly" in selection.warning
    assert "'auto' or 'triton' would be captured" in selection.warning


def test_explicit_capturable_choice_with_graphs_has_no_warning():
    selection = select_attention_backend(
        requirements(device_type="cuda", cuda_graphs=True), "triton"
    )
    assert selection.cuda_graphs and selection.warning is None


def test_auto_without_any_compatible_backend_raises_with_every_reason():
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(requirements(dtype="float64"))
    assert info.value.options == ("attention_backend",)
    assert "torch: dtype float64" in info.value.message and "triton:" in info.value.message


def test_explicit_triton_on_cpu_names_the_device():
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(requirements(), "triton")
    message = info.value.message
    assert "device 'cpu'" in message and "Known backends: torch, triton, flash_attn" in message


def test_explicit_incompatible_choice_lists_every_unmet_requirement_and_option():
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(
            requirements(device_type="cuda", head_dim=512, block_size=16, cuda_graphs=True),
            "torch",
        )
    assert "head_dim 512 > 256" in info.value.message
    assert "CUDA graphs" not in info.value.message  # a preference, never a refusal
    assert info.value.options == ("attention_backend", "model")


def test_explicit_compatible_choice_is_honoured():
    selection = select_attention_backend(requirements(device_type="cuda", dtype="float16"), "torch")
    assert selection.name == "torch" and "explicitly requested" in selection.reason


def test_unknown_backend_lists_known_ones():
    with pytest.raises(
        ConfigurationError, match="unknown backend 'xformers'.*torch, triton, flash_attn"
    ):
        select_attention_backend(requirements(), "xformers")


@pytest.mark.skipif(flash_attn_importable(), reason="flash_attn is importable here")
def test_flash_attn_not_importable_is_rejected_with_reason():
    reqs = requirements(device_type="cuda", dtype="bfloat16", block_size=256)
    selection = select_attention_backend(reqs)
    assert any("flash-attn is not importable here" in r for r in selection.rejected["flash_attn"])
    with pytest.raises(ConfigurationError, match="flash-attn is not importable here") as info:
        select_attention_backend(reqs, "flash_attn")
    assert info.value.options == ("attention_backend",)
    with pytest.raises(RuntimeError, match="not importable"):
        FlashAttnBackend()


def test_flash_attn_by_name_with_the_default_block_size_names_both_options():
    reqs = requirements(device_type="cuda", dtype="bfloat16", block_size=16)
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(reqs, "flash_attn")
    assert info.value.options[:1] == ("attention_backend",)
    assert "block_size" in info.value.options
    assert "block_size 16 is not a multiple of 256" in info.value.message
    assert "block_size=256" in info.value.message
    if not flash_attn_importable():
        assert "flash-attn is not importable here" in info.value.message
        assert info.value.options == ("attention_backend", "block_size")


def test_flash_attn_is_never_auto_selected():
    selection = select_attention_backend(
        requirements(device_type="cuda", dtype="bfloat16", block_size=256)
    )
    assert selection.name == "triton"
    assert any("never auto-selected" in r for r in selection.rejected["flash_attn"])
