"""Backend selection: capability checks, reported reasons, and no silent switching (R13, R14)."""

from __future__ import annotations

import pytest
from rlt_attention import (
    BACKENDS,
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


def test_auto_with_cuda_graphs_rejects_torch():
    selection = select_attention_backend(requirements(device_type="cuda", cuda_graphs=True))
    assert selection.name == "triton"
    assert selection.rejected["torch"] == ["CUDA graphs unsupported"]


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


def test_explicit_incompatible_choice_lists_every_unmet_requirement():
    with pytest.raises(ConfigurationError) as info:
        select_attention_backend(
            requirements(device_type="cuda", head_dim=512, cuda_graphs=True), "torch"
        )
    assert (
        "head_dim 512 > 256" in info.value.message
        and "CUDA graphs unsupported" in info.value.message
    )


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
    assert any("flash_attn not importable" in r for r in selection.rejected["flash_attn"])
    with pytest.raises(ConfigurationError, match="flash_attn not importable"):
        select_attention_backend(reqs, "flash_attn")
    with pytest.raises(RuntimeError, match="not importable"):
        FlashAttnBackend()


def test_flash_attn_is_never_auto_selected():
    selection = select_attention_backend(
        requirements(device_type="cuda", dtype="bfloat16", block_size=256)
    )
    assert selection.name == "triton"
    assert any("never auto-selected" in r for r in selection.rejected["flash_attn"])
