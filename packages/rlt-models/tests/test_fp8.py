"""FP8 weights (rlt_models.fp8, rlt_models.fp8_checkpoint): per-channel quantization within
e4m3's rounding bound, the reference product equal to the dequantized weight's, quantization at
load, the compressed-tensors writer's round trip, and the strict loader's errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from rlt_models import CheckpointError, OuroConfig, load_model, save_checkpoint
from rlt_models.checkpoint_writer import write_random_checkpoint
from rlt_models.fp8 import FP8, FP8_MAX, Fp8Projection, dequantize, quantize_per_channel
from rlt_models.fp8_checkpoint import write_fp8_checkpoint
from rlt_models.safetensors_files import SINGLE_FILE
from safetensors.torch import load_file, save_file

CONFIG = OuroConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    total_ut_steps=4,
    max_position_embeddings=256,
)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp32"), CONFIG, seed=5)


@pytest.fixture(scope="module")
def fp8_dir(source, tmp_path_factory):
    return write_fp8_checkpoint(source, tmp_path_factory.mktemp("fp8"))


def test_quantization_error_is_within_e4m3_rounding():
    """e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below the
    smallest normal (2^-6 of the scale) the spacing is 2^-9, so within 2^-10 x the scale."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 200, generator=generator) * torch.logspace(-3, 1, 48)[:, None]
    weight[5] = 0.0  # a zero row keeps scale MIN_SCALE and Q = 0
    data, scale = quantize_per_channel(weight)
    assert data.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert data.float().abs().amax(dim=1)[torch.arange(48) != 5].eq(FP8_MAX).all()
    error = (dequantize(data, scale, torch.float32) - weight).abs()
    bound = torch.maximum(weight.abs() * 2**-4, scale[:, None] * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()
    assert not dequantize(data, scale, torch.float32)[5].any()


def test_projection_product_is_the_dequantized_weights_and_survives_dtype_casts():
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    projection = Fp8Projection(*quantize_per_channel(weight))
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    assert torch.equal(projection(x), F.linear(x, projection.dequantized(torch.float32)))
    before = projection.data_bytes.clone(), projection.scale_bits.clone()
    projection.to(torch.float64)  # a model-wide dtype cast never rounds the fp8 bytes
    assert torch.equal(projection.data_bytes, before[0])
    assert torch.equal(projection.scale_bits, before[1])
    assert projection.weight.dtype == FP8 and projection.scale.dtype == torch.float32


def test_quantized_load_keeps_gate_head_and_norms_in_float(source):
    model = load_model(source, quantization="fp8")
    assert model.quantization == "fp8" and not model.quantized_lm_head
    for layer in model.layers:
        for weight in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(weight, Fp8Projection)
    assert model.lm_head.dtype == torch.float32
    assert model.early_exit_gate_weight.dtype == torch.float32
    fused = torch.cat(
        [
            load_file(str(source / SINGLE_FILE))[f"model.layers.1.mlp.{p}_proj.weight"]
            for p in ("gate", "up")
        ]
    )
    expected = dequantize(*quantize_per_channel(fused), torch.float32)  # rows are independent
    assert torch.equal(model.layers[1].mlp.gate_up_proj.dequantized(torch.float32), expected)
    assert isinstance(
        load_model(source, quantization="fp8", quantize_lm_head=True).lm_head, Fp8Projection
    )


def test_writer_round_trip_equals_quantizing_at_load(source, fp8_dir):
    raw = json.loads((fp8_dir / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "compressed-tensors"
    stored = load_file(str(fp8_dir / SINGLE_FILE))
    assert stored[Q_PROJ].dtype == FP8 and stored[Q_PROJ + "_scale"].shape == (64, 1)
    assert stored["lm_head.weight"].dtype == torch.float32
    loaded = load_model(fp8_dir)  # fp8 because the checkpoint says so
    quantized = load_model(source, quantization="fp8")
    for a, b in zip(loaded.modules(), quantized.modules(), strict=True):
        if isinstance(a, Fp8Projection):
            assert torch.equal(a.data_bytes, b.data_bytes)
            assert torch.equal(a.scale_bits, b.scale_bits)
    assert (fp8_dir / "tokenizer.json").is_file()
    with pytest.raises(CheckpointError, match="already quantized"):
        write_fp8_checkpoint(fp8_dir, fp8_dir.parent / "again")


def test_export_of_an_fp8_model_is_its_dequantized_twin(source, tmp_path):
    model = load_model(source, quantization="fp8")
    twin = load_model(save_checkpoint(model, tmp_path / "twin", dtype="float32"))
    assert torch.equal(twin.layers[0].qkv_proj, model.layers[0].qkv_proj.dequantized(torch.float32))


def _broken(fp8_dir, tmp_path, edit_tensors=None, edit_config=None):
    out = tmp_path / "broken"
    out.mkdir()
    tensors = load_file(str(fp8_dir / SINGLE_FILE))
    raw = json.loads((fp8_dir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(raw["quantization_config"])
    save_file(tensors, str(out / SINGLE_FILE))
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(Q_PROJ + "_scale"), "missing tensor"),
        (lambda t: t.__setitem__(Q_PROJ + "_scale", torch.ones(64, 2)), "per-channel scale"),
        (lambda t: t.__setitem__(Q_PROJ, t[Q_PROJ].float()), "float8_e4m3fn"),
        (lambda t: t.__setitem__(Q_PROJ, t[Q_PROJ][:32].contiguous()), "shape"),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.input_scale", torch.ones(1)),
            "static activation scales",
        ),
        (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(FP8)), "declares no fp8"),
    ],
    ids=[
        "missing_scale",
        "scale_shape",
        "weight_dtype",
        "weight_shape",
        "input_scale",
        "stray_fp8",
    ],
)
def test_strict_loader_names_what_is_wrong_with_an_fp8_checkpoint(fp8_dir, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(_broken(fp8_dir, tmp_path, edit_tensors=edit))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy"),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (
            lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
            "static activation",
        ),
        (lambda q: q.update(quant_method="gptq"), "compressed-tensors"),
    ],
    ids=["per_tensor", "kv_scheme", "static_activations", "other_method"],
)
def test_unsupported_schemes_are_refused(fp8_dir, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(_broken(fp8_dir, tmp_path, edit_config=edit))


def test_bad_quantization_options_are_refused(source):
    with pytest.raises(ValueError, match="quantization"):
        load_model(source, quantization="int4")
    with pytest.raises(ValueError, match="quantize_lm_head"):
        load_model(source, quantize_lm_head=True)
