"""The engine with an fp8 KV cache (issue 22, `kv_cache_dtype="fp8"`), tiny fp32 models on the
CPU (torch backend): batched equals serial in both layouts, the per-layer scales come from the
checkpoint when it has them (strictly checked) and are calibrated powers of two otherwise, the
pool holds the tokens its byte budget allows at one byte per element, and /v1/models says so.
Prefix caching, preemption and PD with fp8 KV are checked beside their model-dtype runs in
test_memory_and_scheduling_features.py and test_pd_engine.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from rlt import LLM
from rlt_contracts import PDCompatibility
from rlt_models import CheckpointError, DenseCausalAttention, DenseKVCache, load_model
from rlt_models.kv_scales import HEADROOM, calibrate_kv_scales
from rlt_models.safetensors_files import SINGLE_FILE
from safetensors.torch import load_file, save_file
from test_fp8_engine import ENGINE as BASE_ENGINE
from test_fp8_engine import PROMPTS, params

ENGINE = {**BASE_ENGINE, "kv_cache_dtype": "fp8"}


def generate(path, prompts, sampling, **options):
    llm = LLM(path, **{**ENGINE, **options})
    outputs = llm.generate(prompts, sampling)
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
    return [(o.token_ids, o.exit_depths, o.logprobs) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp8_kv_batched_equals_serial(checkpoint, layout):
    batched = generate(checkpoint, PROMPTS, params(), kv_layout=layout)
    serial = [
        generate(checkpoint, [prompt], [p], kv_layout=layout)[0]
        for prompt, p in zip(PROMPTS, params(), strict=True)
    ]
    # tokens and depths exactly; logprobs up to fp32 summation order (batched calls pad and
    # group the attention's products differently on the CPU): 1e-5 absolute
    assert [b[:2] for b in batched] == [s[:2] for s in serial]
    for b, s in zip(batched, serial, strict=True):
        assert (b[2] is None) == (s[2] is None)
        if b[2] is not None:
            assert max(abs(x - y) for x, y in zip(b[2], s[2], strict=True)) < 1e-5
    plain = generate(checkpoint, PROMPTS, params(), kv_layout=layout, kv_cache_dtype="auto")
    assert batched != plain  # the cache's rounding reached the outputs (logprobs at least)


def test_calibrated_scales_are_powers_of_two_over_the_observed_maxima(checkpoint):
    model = load_model(checkpoint)
    token_ids = list(range(3, 120))
    keys, values = calibrate_kv_scales(model, token_ids)
    # the maxima, recorded independently: every loop, every layer, full depth
    seen = {"key": [0.0, 0.0], "value": [0.0, 0.0]}

    def recording(layer, q, k, v, cache):
        seen["key"][layer] = max(seen["key"][layer], k.abs().max().item())
        seen["value"][layer] = max(seen["value"][layer], v.abs().max().item())
        return DenseCausalAttention(cache)(layer, q, k, v)

    with torch.no_grad():
        hidden = model.embed(torch.tensor(token_ids))
        positions = torch.arange(len(token_ids))
        for _ in range(model.shape.num_loops):
            cache = DenseKVCache(2)
            hidden, _ = model.recurrent_step(
                hidden, positions, lambda *a, c=cache: recording(*a, c), compute_gate=False
            )
    for scales, maxima in ((keys, seen["key"]), (values, seen["value"])):
        for scale, largest in zip(scales, maxima, strict=True):
            assert math.log2(scale) == round(math.log2(scale))  # a power of two
            assert scale / 2 < HEADROOM * largest / 448 <= scale
    llm = LLM(checkpoint, **ENGINE)  # calibrated on the sample text: powers of two too
    for scale in (*llm.engine.core.runner.kv.scales.key, *llm.engine.core.runner.kv.scales.value):
        assert math.log2(scale) == round(math.log2(scale))
    info = llm.engine.model_info()
    assert info.kv_cache_dtype == "float8_e4m3fn" and info.weight_dtype == "float32"
    llm.shutdown()


def test_checkpoint_scales_are_used_and_checked(checkpoint, tmp_path):
    given = tmp_path / "with_scales"
    shutil.copytree(checkpoint, given)
    tensors = load_file(given / SINGLE_FILE)
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.25 * (layer + 1))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.125)
    save_file(tensors, given / SINGLE_FILE)
    llm = LLM(given, **ENGINE)
    scales = llm.engine.core.runner.kv.scales
    assert scales.key == (0.25, 0.5) and scales.value == (0.125, 0.125)
    llm.generate(PROMPTS[:2], params()[:2])
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, given / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="some layers only"):
        load_model(given)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(-1.0)
    save_file(tensors, given / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="positive finite"):
        load_model(given)


def test_the_pool_holds_more_tokens_in_the_same_bytes(checkpoint):
    budget = dict(num_kv_blocks=None, cpu_kv_cache_bytes=1 << 16, max_num_seqs=8)
    capacity = {}
    for kv in ("auto", "fp8"):
        llm = LLM(checkpoint, **{**ENGINE, **budget, "kv_cache_dtype": kv})
        capacity[kv] = llm.engine.model_info().kv_capacity_tokens
        llm.shutdown()
    # fp32 model: 4 bytes per element, fp8: 1 (rounded down to whole blocks and planes)
    assert capacity["fp8"] >= 3.9 * capacity["auto"] > 0


def test_pd_handshake_refuses_another_kv_dtype_or_scales():
    base = dict(
        model_identity="m",
        num_layers=2,
        num_loops=4,
        kv_layout="last_exited",
        dtype="bfloat16",
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        block_bytes=4096,
        hidden_bytes=256,
    )
    fp8 = PDCompatibility(**base, kv_cache_dtype="float8_e4m3fn", kv_scales=(0.5, 0.5, 1.0, 1.0))
    plain = PDCompatibility(**base, kv_cache_dtype="bfloat16")
    rescaled = PDCompatibility(
        **base, kv_cache_dtype="float8_e4m3fn", kv_scales=(0.5, 0.25, 1.0, 1.0)
    )
    assert any(m.startswith("kv_cache_dtype") for m in fp8.mismatches(plain))
    assert [m.split(":")[0] for m in fp8.mismatches(rescaled)] == ["kv_scales"]
    assert fp8.mismatches(fp8) == []
