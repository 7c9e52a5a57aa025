"""The bundled default model: intact, loadable, readable, adaptive and deterministic."""

from __future__ import annotations

import hashlib

import pytest
from rlt import LLM, SamplingParams
from rlt.engine.assembly import DEFAULT_MODEL_DIR, DEFAULT_MODEL_SHA256
from rlt_models import OuroConfig, load_model


def test_shipped_checkpoint_matches_recorded_hash_and_size():
    weights = DEFAULT_MODEL_DIR / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == DEFAULT_MODEL_SHA256
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir())
    assert total <= 16 * 1024 * 1024


def test_shipped_checkpoint_loads_as_ouro():
    config = OuroConfig.from_pretrained(DEFAULT_MODEL_DIR)
    assert (config.total_ut_steps, config.num_hidden_layers, config.vocab_size) == (4, 4, 4096)
    model = load_model(DEFAULT_MODEL_DIR)
    assert str(model.dtype) == "torch.bfloat16"
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu")


def test_greedy_generation_is_deterministic_and_english(default_llm):
    params = SamplingParams(max_tokens=24, exit_threshold=0.5)
    first = default_llm.generate(["It is a truth universally acknowledged"], params)[0]
    second = default_llm.generate(["It is a truth universally acknowledged"], params)[0]
    assert (first.token_ids, first.exit_depths, first.text) == (
        second.token_ids,
        second.exit_depths,
        second.text,
    )
    words = first.text.split()
    assert len(words) >= 8
    letters = sum(c.isalpha() for c in first.text)
    assert letters / max(len(first.text), 1) > 0.6  # words, not byte soup


def test_gate_adapts_depth_at_half_threshold(default_llm):
    prompts = ["Fellow-Citizens of the Senate and House of Representatives:", "My dear Emma,"]
    adaptive = default_llm.generate(prompts, SamplingParams(max_tokens=32, exit_threshold=0.5))
    fixed = default_llm.generate(prompts, SamplingParams(max_tokens=32))
    depths = [d for o in adaptive for d in o.exit_depths[1:]]
    assert sum(depths) / len(depths) < 3.5
    assert all(set(o.exit_depths) == {4} for o in fixed)
