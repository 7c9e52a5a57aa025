"""HRM-Text's engine features (issue 38, item 4), tiny fp32 checkpoint written by transformers'
own `HrmTextForCausalLM` (test_family_hrm_text.py) on the CPU: each works exactly, against
transformers' greedy tokens or the engine without the feature, or is refused with the reason.

- fp8 weights (the fused `gqkv_proj` [gate | q | k | v] and `gate_up_proj` quantized per
  output channel): equal the engine on the fp8 model's dequantized fp32 twin, tokens and
  logprobs; a compressed-tensors fp8 checkpoint (fused tensors stored fp8) equals quantizing at
  load. fp8 KV: one calibrated power-of-two scale per KV slot (stack pass x layer), batched
  equals serial.
- PD: the decode side's tokens equal transformers'; the handoff carries the whole two-vector
  state (`state_width == 2 * hidden`): the handshake's row is 2 x hidden values and the row D
  received is [z_H, z_L] of the last prompt position, recomputed here with a bidirectional
  dense attention.
- self-speculative decoding (a one-H-cycle draft of two): greedy tokens equal transformers'.
- prompt scoring: refused for prefix-LM prompts (each position attends to the token it would
  score); with a causal prompt mask it equals transformers' causal forward.
- prefix caching: refused for prefix-LM prompts (their KV depends on the whole prompt); with a
  causal mask hits equal misses equal transformers. Chunked prefill: a prefix-LM prompt is
  prefilled whole whatever `prefill_chunk_size` says (logged). `shared`: refused.
- structured output, synchronous scheduling, cancellation with no KV leak.
`no_refill`, preemption and the HTTP server are in test_family_hrm_text.py.

Tolerances: fp32 against fp32 (transformers, or torch ops in another order) within 1e-5 on
log-probabilities of magnitude ~6 and states of unit RMS (fp32 rounding is ~1e-6 there).
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from family_feature_checks import (
    abort_then_reuse_the_id,
    engine_cache,
    pd_outputs,
    tokens_and_depths,
)
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError, InvalidRequestError, StructuredOutput
from rlt_models import load_model, save_checkpoint
from rlt_models.fp8 import FP8
from rlt_models.fp8_checkpoint import write_fp8_checkpoint
from safetensors.torch import load_file
from test_family_hrm_text import ENGINE, MAX_TOKENS, PROMPTS, reference, write_hf_checkpoint

transformers = pytest.importorskip("transformers")

CAUSAL = {"hf_overrides": {"prefix_lm": False}}


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hrm_text"))


@pytest.fixture(scope="module")
def expected(hf_model_dir):
    return {
        "prefix_lm": reference(hf_model_dir, prefix_lm=True),
        "causal": reference(hf_model_dir, prefix_lm=False),
    }


@pytest.fixture(scope="module")
def engine(hf_model_dir):
    with engine_cache(hf_model_dir, ENGINE) as get:
        yield get


def greedy(max_tokens=MAX_TOKENS, **extra):
    return [SamplingParams(max_tokens=n, ignore_eos=True, **extra) for n in max_tokens]


def tokens(llm, params=None):
    return [o.token_ids for o in llm.generate(PROMPTS, params or greedy())]


# -- fp8 weights and fp8 KV -----------------------------------------------------------------------
def with_logprobs(llm):
    outputs = llm.generate(PROMPTS, greedy(logprobs=2))
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outputs]


def test_fp8_weights_equal_the_dequantized_twin_and_the_fp8_checkpoint(
    hf_model_dir, engine, tmp_path
):
    model = load_model(hf_model_dir, quantization="fp8")
    twin = save_checkpoint(model, tmp_path / "twin", dtype="float32", tokenizer_dir=hf_model_dir)
    fp8 = with_logprobs(engine(quantization="fp8"))
    with engine_cache(twin, ENGINE) as twin_engine:
        assert fp8 == with_logprobs(twin_engine())
    assert fp8 != with_logprobs(engine())  # quantization changed something (logprobs at least)
    written = write_fp8_checkpoint(hf_model_dir, tmp_path / "fp8")
    stored = load_file(str(written / "model.safetensors"))
    gqkv = "model.H_module.layers.0.attn.gqkv_proj.weight"
    assert stored[gqkv].dtype == FP8 and stored[gqkv + "_scale"].shape == (4 * 4 * 16, 1)
    assert stored["model.z_L_init"].dtype == torch.float32  # a learned vector stays as it was
    with engine_cache(written, ENGINE) as from_checkpoint:
        assert with_logprobs(from_checkpoint()) == fp8


def test_fp8_kv_has_a_scale_per_slot_and_batched_equals_serial(engine):
    llm = engine(kv_cache_dtype="fp8")
    scales = llm.engine.core.runner.kv.scales
    slots = llm.engine.parts.model.shape.num_layers  # 2 layers x (2 L passes + 1 H pass)
    assert slots == 6 and len(scales.key) == len(scales.value) == slots
    assert all(math.log2(s) == round(math.log2(s)) for s in (*scales.key, *scales.value))
    batched = llm.generate(PROMPTS, greedy(logprobs=1))
    serial = [llm.generate([p], [s])[0] for p, s in zip(PROMPTS, greedy(logprobs=1), strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]
    for b, s in zip(batched, serial, strict=True):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)


# -- prefill/decode disaggregation ----------------------------------------------------------------
@pytest.fixture
def make_engine(hf_model_dir):
    """Fresh engines per call (a PD pair holds per-pair state), checked for leaks."""
    with engine_cache(hf_model_dir, ENGINE, reuse=False) as make:
        yield make


@pytest.mark.parametrize(
    ("nixl", "options"),
    [(False, {}), (False, dict(kv_cache_dtype="fp8")), (True, {})],
    ids=["loopback", "loopback-fp8_kv", "nixl"],
)
def test_pd_output_equals_a_single_engine(make_engine, engine, expected, nixl, options):
    single = tokens_and_depths(engine(**options).generate(PROMPTS, greedy()))
    if not options:
        assert [t for t, _ in single] == expected["prefix_lm"]
    outputs, pair, _ = pd_outputs(make_engine, PROMPTS, greedy(), nixl=nixl, **options)
    assert tokens_and_depths(outputs) == single
    if pair is not None:
        assert pair.written == {f"t{i}": len(p) for i, p in enumerate(PROMPTS)}


def bidirectional_attention(slot, query, key, value):
    """Dense attention of every position to every position (one prompt block)."""
    scores = torch.einsum("qhd,khd->hqk", query, key) * query.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


@torch.no_grad()
def test_the_handoff_carries_both_state_vectors(make_engine, hf_model_dir):
    prompt = PROMPTS[2]
    [output], _, (prefill, decode) = pd_outputs(make_engine, [prompt], greedy([4]), nixl=True)
    assert output.finish_reason == "length"
    hidden = load_model(hf_model_dir).config.hidden_size
    for llm in (prefill, decode):  # the transport registers whole rows of the state
        assert llm.engine.parts.pd.compatibility.hidden_bytes == 2 * hidden * 4
    landing = decode.engine.core.runner.rows.landing
    [row] = landing.abs().sum(-1).nonzero().flatten().tolist()  # the one row P wrote
    model = load_model(hf_model_dir)
    state = model.embed(torch.tensor(prompt))
    positions = torch.arange(len(prompt))
    for _ in range(model.shape.num_loops):
        state, _ = model.recurrent_step(state, positions, bidirectional_attention)
    z_low = state[-1, hidden:]
    assert landing[row] == pytest.approx(state[-1], abs=1e-5)
    assert not torch.allclose(z_low, model.z_L_init)  # z_L is the L passes' output, not its init


# -- self-speculative decoding --------------------------------------------------------------------
@pytest.mark.parametrize(("drafts", "mode"), [(3, "refill"), (2, "no_refill")])
def test_speculation_with_a_one_cycle_draft_equals_transformers(engine, expected, drafts, mode):
    llm = engine(num_speculative_tokens=drafts, speculative_draft_loops=1, scheduling_mode=mode)
    before = llm.get_stats()
    outputs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outputs] == expected["prefix_lm"]
    assert all(o.exit_depths == [2] * len(o.token_ids) for o in outputs)
    after = llm.get_stats()
    assert after.spec_drafts > before.spec_drafts
    assert after.spec_accepted_tokens > before.spec_accepted_tokens


# -- prompt scoring, prefix caching, chunked prefill, shared KV -----------------------------------
def test_prompt_scoring_is_refused_for_prefix_lm_prompts_and_causal_ones_equal_transformers(
    hf_model_dir, engine
):
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="prefix-LM") as refused:
        engine().generate([PROMPTS[0]], scored)
    assert refused.value.field == "prompt_logprobs"
    model = transformers.HrmTextForCausalLM.from_pretrained(hf_model_dir).eval()
    llm = engine(**CAUSAL, prefill_chunk_size=3)  # scores across chunk boundaries
    for prompt in PROMPTS:
        out = llm.generate([prompt], scored)[0]
        with torch.no_grad():  # no token_type_ids: transformers' causal prompt
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = [float(logprobs[i, t]) for i, t in enumerate(prompt[1:])]
        assert out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-5)


def test_prefix_caching_is_refused_for_prefix_lm_prompts_and_exact_for_causal_ones(
    hf_model_dir, engine, expected
):
    with pytest.raises(ConfigurationError, match="depends on the whole prompt"):
        LLM(hf_model_dir, **ENGINE, enable_prefix_caching=True)
    with pytest.raises(ConfigurationError, match="slot per stack pass"):
        LLM(hf_model_dir, **ENGINE, kv_layout="shared")
    llm = engine(**CAUSAL, enable_prefix_caching=True, prefill_chunk_size=3)
    assert tokens(llm) == expected["causal"]  # misses
    assert tokens(llm) == expected["causal"]  # every prompt's full pages hit
    assert llm.get_stats().prefix_cache_hit_tokens > 0


def test_a_prefix_lm_prompt_is_never_chunked(hf_model_dir, expected, caplog):
    with caplog.at_level(logging.INFO, logger="rlt.engine.family_setup"):
        llm = LLM(hf_model_dir, **ENGINE, prefill_chunk_size=3)
    assert "prefilled whole in one step" in caplog.text
    with llm:
        llm.engine.core.step_log = []  # every applied step, with its prompt tokens
        assert tokens(llm) == expected["prefix_lm"]
        prompt_steps = [r.prefill_tokens for r in llm.engine.core.step_log if r.prefill_tokens]
    # each prompt in one step (11 tokens, though chunks of 3 were asked), or several together
    assert sum(prompt_steps) == sum(len(p) for p in PROMPTS) and max(prompt_steps) >= 11


# -- structured output, scheduling, cancellation --------------------------------------------------
REGEX = r"[A-Z][a-z]{1,4}-\d{2,3}"


def test_structured_output_constrains_the_tokens(engine, expected):
    regex = SamplingParams(
        max_tokens=16, structured_output=StructuredOutput(kind="regex", regex=REGEX)
    )
    outputs = engine().generate(PROMPTS, [regex, *greedy(MAX_TOKENS[1:])])
    assert re.fullmatch(REGEX, outputs[0].text) and outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == expected["prefix_lm"][1:]


def test_synchronous_scheduling_equals_transformers(engine, expected):
    assert tokens(engine(async_scheduling=False)) == expected["prefix_lm"]


def test_cancellation_frees_every_block_and_the_id_is_reused(engine, expected):
    prompts = [PROMPTS[0], list(range(3, 40)), PROMPTS[2]]
    finals = abort_then_reuse_the_id(engine(), prompts, greedy([MAX_TOKENS[0], 5, MAX_TOKENS[2]]))
    assert finals["r0-aborted"].finish_reason == "abort" and finals["r0-aborted"].token_ids
    assert finals["r1"].finish_reason == "abort"
    assert finals["r0"].token_ids == expected["prefix_lm"][0]
    assert finals["r2"].token_ids == expected["prefix_lm"][2]
