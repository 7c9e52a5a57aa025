"""Nanbeige4.2's engine features (issue 38, item 4), tiny fp32 checkpoint on the CPU: each
works exactly, against the dense float64 reference of test_family_nanbeige.py or against the
engine without the feature; the family refuses none.

- `shared` KV layout: equals the reference with SHARED semantics (written here: positions
  advance one at a time through every loop, each loop overwriting the one plane, so a
  position reads the final loop's keys of earlier positions and its own current loop's).
- self-speculative decoding (no exit signal: the draft runs fewer loops): greedy tokens and
  depths equal the reference, drafts were accepted, both scheduling modes and a request run
  at one loop (as deep as the draft).
- fp8 weights (GQA projections quantized per channel): equal the engine on the fp8 model's
  dequantized fp32 twin, tokens and logprobs (the same fp32 values multiplied in the same
  calls); a compressed-tensors fp8 checkpoint equals quantizing at load.
- fp8 KV: batched equals serial, one power-of-two scale per layer shared by both loop planes;
  PD moves the fp8 bytes as they are.
- PD (loopback port and NIXL): the decode side's output equals a single engine's.
- prompt scoring: every prompt token's log-probability equals the reference's log-softmax
  (full depth; at the exit depth, which is the request's depth here, the same).
- structured output, synchronous scheduling, cancellation with no KV leak.
Chunked prefill, prefix caching, preemption and `no_refill` are in test_family_nanbeige.py.

Tolerances: rlt fp32 against the fp64 reference; log-probabilities (magnitude ~6) within 1e-5
(measured 3e-7); greedy steps are conditioned as in test_family_nanbeige.py (MARGIN).
"""

from __future__ import annotations

import json
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
from rlt import SamplingParams
from rlt_contracts import StructuredOutput
from rlt_models import load_model, save_checkpoint, write_random_checkpoint
from rlt_models.fp8_checkpoint import write_fp8_checkpoint
from safetensors.torch import load_file
from test_family_nanbeige import (
    CONFIG,
    ENGINE,
    MARGIN,
    MAX_TOKENS,
    PROMPTS,
    _rms,
    _rope,
    greedy,
    reference_greedy,
    reference_logits,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("nanbeige"), CONFIG, seed=11)


@pytest.fixture(scope="module")
def engine(checkpoint):
    with engine_cache(checkpoint, ENGINE) as get:
        yield get


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {
        loops: [
            reference_greedy(checkpoint, p, n, loops)
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        for loops in (1, 2)
    }


def plain(max_loops=None):
    return [greedy(n, max_loops=max_loops) for n in MAX_TOKENS]


def run(llm, prompts=PROMPTS, params=None):
    return tokens_and_depths(llm.generate(prompts, params or plain()))


# -- shared KV layout -----------------------------------------------------------------------------
def shared_reference_last_logits(weights, raw, ids):
    """Logits after the last position's loops under SHARED semantics (module doc), fp64."""
    w = {k: v.double() for k, v in weights.items()}
    eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
    heads, kv_heads, d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    layers = raw["num_hidden_layers"]
    plane = {i: ([], []) for i in range(layers)}  # layer -> final keys, values of each position
    for position, token in enumerate(ids):
        where = torch.tensor([position])
        x = w["model.embed_tokens.weight"][token][None]
        for _ in range(raw["num_loops"]):
            y, written = x, {}
            for i in range(layers):
                p = f"model.layers.{i}."
                h = _rms(y, w[p + "input_layernorm.weight"], eps)
                q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).view(1, heads, d), where, theta)
                k = _rope(
                    (h @ w[p + "self_attn.k_proj.weight"].T).view(1, kv_heads, d), where, theta
                )
                v = (h @ w[p + "self_attn.v_proj.weight"].T).view(1, kv_heads, d)
                written[i] = (k, v)
                keys = torch.cat([*plane[i][0], k]).repeat_interleave(heads // kv_heads, 1)
                values = torch.cat([*plane[i][1], v]).repeat_interleave(heads // kv_heads, 1)
                probs = (torch.einsum("qhd,khd->hqk", q, keys) * d**-0.5).softmax(-1)
                attn = torch.einsum("hqk,khd->qhd", probs, values).reshape(1, heads * d)
                y = y + attn @ w[p + "self_attn.o_proj.weight"].T
                m = _rms(y, w[p + "post_attention_layernorm.weight"], eps)
                gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
                y = y + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
            x = _rms(y, w["model.norm.weight"], eps)
        for i, (k, v) in written.items():  # the last loop's entry stays in the plane
            plane[i][0].append(k)
            plane[i][1].append(v)
    return (x @ w["lm_head.weight"].T)[0]


def shared_reference_greedy(path, prompt, max_tokens):
    weights = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = shared_reference_last_logits(weights, raw, ids)
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def shared_expected(checkpoint):
    return [
        shared_reference_greedy(checkpoint, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_the_shared_layout_equals_its_reference(engine, shared_expected, expected, mode):
    got = run(engine(kv_layout="shared", scheduling_mode=mode))
    assert [tokens for tokens, _ in got] == shared_expected
    assert shared_expected != expected[2]  # the layout's semantics differ from per-loop KV
    assert all(depths == [2] * len(depths) for _, depths in got)


# -- self-speculative decoding --------------------------------------------------------------------
@pytest.mark.parametrize(("drafts", "mode"), [(3, "refill"), (2, "no_refill")])
def test_speculation_with_a_one_loop_draft_equals_the_reference(engine, expected, drafts, mode):
    llm = engine(num_speculative_tokens=drafts, speculative_draft_loops=1, scheduling_mode=mode)
    before = llm.get_stats()
    got = run(llm)
    assert got == [(tokens, [2] * len(tokens)) for tokens in expected[2]]
    # a request as shallow as the draft (max_loops 1) beside full-depth ones
    mixed = [greedy(n, max_loops=1 if i == 1 else None) for i, n in enumerate(MAX_TOKENS)]
    assert [t for t, _ in run(llm, params=mixed)] == [expected[1 + (i != 1)][i] for i in range(3)]
    after = llm.get_stats()
    assert after.spec_drafts > before.spec_drafts
    assert after.spec_accepted_tokens > before.spec_accepted_tokens  # the accept path ran


# -- fp8 weights and fp8 KV -----------------------------------------------------------------------
def scored_params():
    return [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]


def with_logprobs(llm, params=None):
    outputs = llm.generate(PROMPTS, params or scored_params())
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outputs]


def test_fp8_weights_equal_the_dequantized_twin_and_the_fp8_checkpoint(
    checkpoint, engine, tmp_path
):
    model = load_model(checkpoint, quantization="fp8")
    twin = save_checkpoint(model, tmp_path / "twin", dtype="float32", tokenizer_dir=checkpoint)
    fp8 = with_logprobs(engine(quantization="fp8"))
    with engine_cache(twin, ENGINE) as twin_engine:
        assert fp8 == with_logprobs(twin_engine())
    assert fp8 != with_logprobs(engine())  # quantization changed something (logprobs at least)
    written = write_fp8_checkpoint(checkpoint, tmp_path / "fp8")
    with engine_cache(written, ENGINE) as stored:
        assert with_logprobs(stored()) == fp8
        assert stored().engine.model_info().weight_dtype == "float8_e4m3fn"


def test_fp8_kv_batched_equals_serial_with_a_scale_per_layer(engine):
    llm = engine(kv_cache_dtype="fp8")
    scales = llm.engine.core.runner.kv.scales
    assert len(scales.key) == len(scales.value) == CONFIG.num_hidden_layers
    assert all(math.log2(s) == round(math.log2(s)) for s in (*scales.key, *scales.value))
    batched = llm.generate(PROMPTS, scored_params())
    serial = [llm.generate([p], [s])[0] for p, s in zip(PROMPTS, scored_params(), strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]
    for b, s in zip(batched, serial, strict=True):  # fp32 summation order: 1e-5
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)
    plain_logprobs = [o.logprobs for o in engine().generate(PROMPTS, scored_params())]
    assert [o.logprobs for o in batched] != plain_logprobs  # the cache's rounding shows


# -- prefill/decode disaggregation ----------------------------------------------------------------
PD_PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13], [250, 11], PROMPTS[2]]


def pd_params():
    return [
        SamplingParams(
            max_tokens=6 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=40 + i
        )
        for i in range(len(PD_PROMPTS))
    ]


@pytest.fixture
def make_engine(checkpoint):
    """Fresh engines per call (a PD pair holds per-pair state), checked for leaks."""
    with engine_cache(checkpoint, ENGINE, reuse=False) as make:
        yield make


@pytest.mark.parametrize(
    ("nixl", "options"),
    [(False, {}), (False, dict(kv_layout="shared")), (False, dict(kv_cache_dtype="fp8"))]
    + [(True, {})],
    ids=["loopback", "loopback-shared", "loopback-fp8_kv", "nixl"],
)
def test_pd_output_equals_a_single_engine(make_engine, engine, nixl, options):
    expected = tokens_and_depths(engine(**options).generate(PD_PROMPTS, pd_params()))
    outputs, pair, _ = pd_outputs(make_engine, PD_PROMPTS, pd_params(), nixl=nixl, **options)
    assert tokens_and_depths(outputs) == expected
    assert all(o.finish_reason == "length" for o in outputs)
    if pair is not None:  # every prompt position went over the port exactly once
        assert pair.written == {f"t{i}": len(p) for i, p in enumerate(PD_PROMPTS)}


# -- prompt scoring, structured output, scheduling, cancellation ---------------------------------
def test_prompt_logprobs_equal_the_reference(checkpoint, engine):
    weights = load_file(str(checkpoint / "model.safetensors"))
    raw = json.loads((checkpoint / "config.json").read_text())
    llm = engine()  # prompts chunked by 5: scores cross chunk boundaries
    for at_exit_depth in (False, True):
        params = SamplingParams(
            max_tokens=2, prompt_logprobs=1, score_at_exit_depth=at_exit_depth, ignore_eos=True
        )
        for prompt in PROMPTS:
            out = llm.generate([prompt], params)[0]
            logprobs = reference_logits(weights, raw, prompt, [2] * len(prompt)).log_softmax(-1)
            want = [float(logprobs[i, t]) for i, t in enumerate(prompt[1:])]
            assert out.prompt_logprobs[0] is None
            assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-5)
            if at_exit_depth:  # no exit signal: every position at the request's depth
                assert out.prompt_exit_depths == [None] + [2] * (len(prompt) - 1)


REGEX = r"[A-Z][a-z]{1,4}-\d{2,3}"


def test_structured_output_constrains_the_tokens(engine, expected):
    llm = engine()
    regex = SamplingParams(
        max_tokens=16, structured_output=StructuredOutput(kind="regex", regex=REGEX)
    )
    choice = SamplingParams(
        max_tokens=16, structured_output=StructuredOutput(kind="choice", choices=("yes", "no"))
    )
    outputs = llm.generate(PROMPTS, [regex, choice, greedy(MAX_TOKENS[2])])
    assert re.fullmatch(REGEX, outputs[0].text) and outputs[0].finish_reason == "stop"
    assert outputs[1].text in ("yes", "no") and outputs[1].finish_reason == "stop"
    assert outputs[2].token_ids == expected[2][2]  # a free request beside them is unchanged


def test_synchronous_scheduling_equals_the_reference(engine, expected):
    assert [t for t, _ in run(engine(async_scheduling=False))] == expected[2]


def test_cancellation_frees_every_block_and_the_id_is_reused(checkpoint, engine, expected):
    params = [greedy(12), greedy(MAX_TOKENS[1]), greedy(MAX_TOKENS[2])]
    prompts = [PROMPTS[0], list(range(3, 40)), PROMPTS[2]]  # r1's prompt spans 8 chunks
    finals = abort_then_reuse_the_id(engine(), prompts, params)
    assert finals["r0-aborted"].finish_reason == "abort" and finals["r0-aborted"].token_ids
    assert finals["r1"].finish_reason == "abort" and not finals["r1"].token_ids
    assert finals["r0"].token_ids == reference_greedy(checkpoint, PROMPTS[0], 12, 2)
    assert finals["r2"].token_ids == expected[2][2]
