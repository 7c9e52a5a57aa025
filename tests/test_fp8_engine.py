"""The engine with fp8 weights (issue 22), on tiny fp32 models on the CPU (reference path:
dequantize, then the fp32 product).

- `--quantization fp8` equals the engine on the fp8 model's dequantized fp32 twin (the
  checkpoint `save_checkpoint` exports from it): tokens, exit depths and logprobs identical,
  since the same fp32 values are multiplied in the same calls; for every exit policy kind
  used here, both KV layouts and with the quantized LM head.
- Batched equals serial under fp8; a compressed-tensors fp8 checkpoint (the project's writer)
  equals quantizing at load; nothing leaks.
- The server reports the weight and KV dtypes and the KV capacity in tokens on /v1/models.
"""

from __future__ import annotations

import pytest
from rlt import LLM, SamplingParams
from rlt.engine import EngineConfig
from rlt_contracts import ConfigurationError
from rlt_models import load_model, save_checkpoint
from rlt_models.fp8_checkpoint import write_fp8_checkpoint
from serving_harness import run_server

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45], [7]]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)


def params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, exit_threshold=0.55, min_loops=1, ignore_eos=True),
        SamplingParams(max_tokens=6, exit_threshold=1.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, exit_threshold=0.7, temperature=0.8, seed=3, top_p=0.9),
        SamplingParams(max_tokens=7, exit_threshold=0.4, min_loops=1, ignore_eos=True),
    ]


def generate(path, prompts=PROMPTS, sampling=None, **options):
    llm = LLM(path, **{**ENGINE, **options})
    outputs = llm.generate(prompts, sampling or params())
    assert llm.engine.core.leak_report() == []
    llm.shutdown()
    return [(o.token_ids, o.exit_depths, o.logprobs, o.top_logprobs) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


@pytest.fixture(scope="module")
def twin(checkpoint, tmp_path_factory):
    """The fp8 model's dequantized fp32 twin, and the same with the LM head quantized."""
    out = tmp_path_factory.mktemp("twins")
    paths = {}
    for head in (False, True):
        model = load_model(checkpoint, quantization="fp8", quantize_lm_head=head)
        paths[head] = save_checkpoint(
            model, out / f"head_{head}", dtype="float32", tokenizer_dir=checkpoint
        )
    return paths


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp8_engine_equals_its_dequantized_fp32_twin(checkpoint, twin, layout):
    fp8 = generate(checkpoint, quantization="fp8", kv_layout=layout)
    assert fp8 == generate(twin[False], kv_layout=layout)
    assert fp8 != generate(checkpoint, kv_layout=layout)  # quantization changed something
    assert any(d < 4 for _, depths, *_ in fp8 for d in depths[1:])


def test_quantized_lm_head_equals_its_twin(checkpoint, twin):
    options = dict(quantization="fp8", quantize_lm_head=True)
    assert generate(checkpoint, **options) == generate(twin[True])


def test_fp8_batched_equals_serial(checkpoint):
    greedy = [SamplingParams(max_tokens=8, exit_threshold=0.55, min_loops=1, ignore_eos=True)]
    batched = generate(checkpoint, sampling=greedy * len(PROMPTS), quantization="fp8")
    serial = [
        generate(checkpoint, prompts=[p], sampling=greedy, quantization="fp8", max_num_seqs=1)[0]
        for p in PROMPTS
    ]
    assert batched == serial


def test_fp8_checkpoint_equals_quantizing_at_load(checkpoint, tmp_path):
    written = write_fp8_checkpoint(checkpoint, tmp_path / "fp8")
    assert generate(written) == generate(checkpoint, quantization="fp8")


def test_bad_quantization_options_are_configuration_errors(checkpoint):
    with pytest.raises(ConfigurationError, match="quantization"):
        EngineConfig.from_options(model=checkpoint, quantization="int4")
    with pytest.raises(ConfigurationError, match="quantize_lm_head"):
        LLM(checkpoint, **ENGINE, quantize_lm_head=True)


def test_models_route_reports_weight_and_kv_dtypes(checkpoint):
    with run_server(checkpoint, served_model_name="tiny", engine={"quantization": "fp8"}) as s:
        with s.http() as http:
            card = http.get("/v1/models").json()["data"][0]
    assert card["weight_dtype"] == "float8_e4m3fn"
    assert card["kv_cache_dtype"] == "float32"
    assert card["kv_capacity_tokens"] > 0
