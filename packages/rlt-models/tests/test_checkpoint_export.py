"""Checkpoint export: runtime model -> Hugging Face names -> `load_model` is bit-exact."""

from __future__ import annotations

import json

import pytest
import torch
from rlt_models import (
    OuroConfig,
    build_model,
    checkpoint_tensors,
    load_model,
    load_tokenizer,
    random_ouro_tensors,
    save_checkpoint,
    write_random_checkpoint,
)
from safetensors.torch import load_file

CONFIG = OuroConfig(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    total_ut_steps=3,
    max_position_embeddings=64,
    rope_theta=10_000.0,
)


@pytest.fixture
def model():
    return build_model(CONFIG, random_ouro_tensors(CONFIG, seed=11), dtype=torch.float32)


def test_checkpoint_tensors_invert_build_model(model):
    source = random_ouro_tensors(CONFIG, seed=11)
    exported = checkpoint_tensors(model)
    assert list(exported) == list(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_then_load_is_bit_exact(tmp_path, model, dtype):
    out = save_checkpoint(model, tmp_path / dtype, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == dtype and config["rope_theta"] == 10_000.0
    expected_config = OuroConfig(**{**CONFIG.__dict__, "torch_dtype": dtype})
    assert OuroConfig.from_pretrained(out) == expected_config
    stored = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == getattr(torch, dtype) for t in stored.values())
    loaded = load_model(out)
    assert loaded.dtype == getattr(torch, dtype)
    expected = model.to(getattr(torch, dtype)).state_dict()
    actual = loaded.state_dict()
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[k], expected[k]) for k in expected)


def test_tokenizer_files_are_copied(tmp_path, model):
    source = write_random_checkpoint(tmp_path / "source", CONFIG)
    out = save_checkpoint(model, tmp_path / "out", tokenizer_dir=source)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    assert load_tokenizer(out).eos_token_id == 0


def test_bad_arguments_raise(tmp_path, model):
    with pytest.raises(ValueError, match="dtype"):
        save_checkpoint(model, tmp_path / "a", dtype="int8")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        save_checkpoint(model, tmp_path / "b", tokenizer_dir=tmp_path)
    assert not (tmp_path / "b").exists()
