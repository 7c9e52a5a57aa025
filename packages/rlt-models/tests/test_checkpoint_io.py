"""Checkpoint writing and strict loading: round trips, sharding, dtypes and every load error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rlt_models import (
    CheckpointError,
    ModelConfigError,
    OuroConfig,
    load_model,
    random_ouro_tensors,
    write_random_checkpoint,
)
from rlt_models.safetensors_files import iter_checkpoint_tensors
from rlt_models.weights import checkpoint_tensor_shapes
from safetensors.torch import load_file, save_file

CONFIG = OuroConfig(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    total_ut_steps=3,
    max_position_embeddings=128,
)


@pytest.fixture
def ckpt(tmp_path):
    return write_random_checkpoint(tmp_path / "ckpt", CONFIG, seed=7)


def test_written_checkpoint_has_hugging_face_layout(ckpt):
    names = {p.name for p in ckpt.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["total_ut_steps"] == 3
    stored = load_file(str(ckpt / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == checkpoint_tensor_shapes(CONFIG)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_load_back_is_bit_exact(tmp_path, dtype):
    path = write_random_checkpoint(tmp_path / dtype, CONFIG, seed=7, dtype=dtype)
    stored = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == getattr(torch, dtype) for t in stored.values())
    model = load_model(path, dtype=dtype)
    params = dict(model.named_parameters())
    q, kv = 4 * 8, 2 * 8
    layer0 = params["layers.0.qkv_proj"]
    assert torch.equal(layer0[:q], stored["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(layer0[q : q + kv], stored["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(layer0[q + kv :], stored["model.layers.0.self_attn.v_proj.weight"])
    gate_up = params["layers.1.mlp.gate_up_proj"]
    assert torch.equal(gate_up[:64], stored["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(gate_up[64:], stored["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(params["lm_head"], stored["lm_head.weight"])
    assert torch.equal(params["early_exit_gate_bias"], stored["model.early_exit_gate.bias"])
    assert torch.equal(
        params["layers.1.input_layernorm_2.weight"],
        stored["model.layers.1.input_layernorm_2.weight"],
    )


def test_writer_is_reproducible_from_seed():
    a = random_ouro_tensors(CONFIG, seed=3)
    b = random_ouro_tensors(CONFIG, seed=3)
    c = random_ouro_tensors(CONFIG, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_a_prefix_std_scales_only_its_tensors_from_the_same_noise():
    from rlt_models import RandomInit

    base = random_ouro_tensors(CONFIG, seed=3)
    init = RandomInit(weight_std_by_prefix=(("model.layers.1.", 0.002), ("model.layers.", 0.5)))
    scaled = random_ouro_tensors(CONFIG, seed=3, init=init)
    for name, tensor in base.items():
        if "norm" in name:  # RMSNorm weights keep 1 + jitter * noise
            assert torch.equal(scaled[name], tensor), name
        elif name.startswith("model.layers.1."):  # the first matching prefix wins
            torch.testing.assert_close(scaled[name], tensor * (0.002 / 0.02), rtol=1e-6, atol=0)
        elif name.startswith("model.layers.0."):
            torch.testing.assert_close(scaled[name], tensor * (0.5 / 0.02), rtol=1e-6, atol=0)
        else:
            assert torch.equal(scaled[name], tensor), name


def test_sharded_checkpoint_loads_identically(tmp_path, ckpt):
    sharded = write_random_checkpoint(tmp_path / "sharded", CONFIG, seed=7, max_shard_bytes=20_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    single = dict(iter_checkpoint_tensors(ckpt))
    multi = dict(iter_checkpoint_tensors(sharded))
    assert single.keys() == multi.keys()
    assert all(torch.equal(single[k], multi[k]) for k in single)
    a, b = load_model(ckpt), load_model(sharded)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_dtype_override_and_auto(ckpt):
    assert load_model(ckpt).dtype == torch.float32  # auto = config torch_dtype
    assert load_model(ckpt, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="dtype"):
        load_model(ckpt, dtype="int8")


def _rewrite(ckpt, mutate):
    tensors = load_file(str(ckpt / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_model(ckpt)


def test_extra_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.rotary_emb.inv_freq": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.rotary_emb\.inv_freq'"):
        load_model(ckpt)


def test_wrong_shape_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(
        CheckpointError, match=r"'model\.norm\.weight' has shape \(31,\), expected \(32,\)"
    ):
        load_model(ckpt)


def test_corrupted_file_is_reported(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(ckpt)


def test_missing_weights_and_missing_shard(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)
    sharded = write_random_checkpoint(tmp_path / "sharded", CONFIG, seed=7, max_shard_bytes=20_000)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard model-00002"):
        load_model(sharded)


def _edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model_type": "qwen2"}, "model_type"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding_window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"mystery_option": 3}, "mystery_option"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_or_unknown_config_fields_are_named(ckpt, changes, field):
    _edit_config(ckpt, **changes)
    with pytest.raises(ModelConfigError) as info:
        load_model(ckpt)
    assert field in info.value.options


def test_config_round_trip_and_real_ouro_keys(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert OuroConfig.from_dict(raw) == OuroConfig(**{**CONFIG.__dict__, "torch_dtype": "float32"})
    # keys that the released Ouro config.json carries are accepted
    raw.update(
        {
            "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig"},
            "max_window_layers": 28,
            "initializer_range": 0.02,
            "use_cache": True,
            "transformers_version": "4.55.0",
            "early_exit_threshold": 1.0,
            "sliding_window": None,
        }
    )
    assert OuroConfig.from_dict(raw).total_ut_steps == 3


def test_malformed_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model(ckpt)
    shutil.rmtree(ckpt)
    with pytest.raises(ModelConfigError, match="not found"):
        load_model(ckpt)


def test_ouro_1_4b_shape_parameter_count():
    config = OuroConfig.ouro_1_4b()
    assert config.num_parameters() == 1_434_652_673
    shapes = checkpoint_tensor_shapes(config)
    assert len(shapes) == 269
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 1_434_652_673
