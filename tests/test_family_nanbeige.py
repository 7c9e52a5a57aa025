"""Nanbeige4.2 (Llama layers x `num_loops`, the final norm after every loop, no exit signal)
served exactly: rlt's greedy tokens equal a dense float64 reference written here from the
family's math (model-families.md section 3; it shares no code with rlt-models), for the loop
count of the config, of `hf_overrides` and of the request; batched equals serial; scheduling
modes, prefix hits and preemption change nothing; no KV leaks (llm_factory's check).

Conditioning: rlt runs fp32, the reference fp64; each greedy step's top-2 logit gap in the
reference must exceed MARGIN (1e-4, far above fp32 rounding of these O(1) logits), so equal
tokens are expected, not luck.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError, InvalidRequestError
from rlt_models import ModelConfigError, NanbeigeConfig, write_random_checkpoint
from safetensors.torch import load_file

MARGIN = 1e-4
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 5, 6]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)
CONFIG = NanbeigeConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA as the release (48 / 8)
    head_dim=16,
    num_loops=2,
    max_position_embeddings=256,
    rope_theta=70_000_000.0,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("nanbeige"), CONFIG, seed=11)


# -- the dense reference (float64, whole sequence recomputed each step) ----------------------
def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [n, heads, d]: split-half rotation
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv[None]
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_logits(weights, raw, ids, depths):
    """Logits of every position after its own number of loops (`depths`). A position that
    stopped at loop e < t offers later queries at loop t its loop-e keys and values (rlt's
    `last_exited` layout; with equal depths this is plain per-loop KV)."""
    w = {k: v.double() for k, v in weights.items()}
    eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
    heads, kv_heads, d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    n = len(ids)
    positions = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    depth = torch.tensor(depths)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    kept_kv = {}  # layer -> (k, v) of each position's latest loop
    for loop in range(1, max(depths) + 1):
        running = (depth >= loop)[:, None]
        y = x
        for i in range(raw["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = _rms(y, w[p + "input_layernorm.weight"], eps)
            q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d), positions, theta)
            k = _rope(
                (h @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d), positions, theta
            )
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
            if i in kept_kv:  # stopped positions keep their last loop's keys and values
                k = torch.where(running[:, :, None], k, kept_kv[i][0])
                v = torch.where(running[:, :, None], v, kept_kv[i][1])
            kept_kv[i] = (k, v)
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d)
            y = y + attn @ w[p + "self_attn.o_proj.weight"].T
            m = _rms(y, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            y = y + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        y = _rms(y, w["model.norm.weight"], eps)  # the final norm after every loop
        x = torch.where(running, y, x)
    return x @ w["lm_head.weight"].T


def reference_greedy(path, prompt, max_tokens, loops, prompt_loops=None):
    """Greedy tokens; the prompt runs `prompt_loops` (default `loops`), later tokens `loops`."""
    weights = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    return reference_greedy_from(weights, raw, prompt, max_tokens, loops, prompt_loops)


def reference_greedy_from(weights, raw, prompt, max_tokens, loops, prompt_loops=None):
    ids = list(prompt)
    depths = [prompt_loops or loops] * len(prompt)
    for _ in range(max_tokens):
        logits = reference_logits(weights, raw, ids, depths)[-1]
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        ids.append(int(logits.argmax()))
        depths.append(loops)
    return ids[len(prompt) :]


def greedy(max_tokens, **loops):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **loops)


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, **loops):
    return llm.generate(prompts, [greedy(n, **loops) for n in max_tokens])


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {
        loops: [
            reference_greedy(checkpoint, p, n, loops)
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        for loops in (1, 2, 3)
    }


@pytest.fixture
def engines(checkpoint):
    made = []

    def make(**options):
        llm = LLM(checkpoint, **{**ENGINE, **options})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert llm.engine.core.leak_report() == []
        llm.shutdown()


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_greedy_tokens_equal_the_dense_reference_at_the_configs_depth(engines, expected, mode):
    llm = engines(scheduling_mode=mode)
    assert llm.engine.model_info().family == "nanbeige"
    outputs = generate(llm)
    for output, tokens in zip(outputs, expected[2], strict=True):
        assert output.token_ids == tokens
        assert output.exit_depths == [2] * len(tokens)  # no exit signal: the full depth


def test_a_request_may_ask_fewer_loops(engines, expected):
    """max_loops=1 of 2 (min_loops unset: 1 without an exit signal): the prompt, token 0 and
    every later token run one loop, as the model would with num_loops=1."""
    llm = engines()
    outputs = generate(llm, max_loops=1)
    assert [o.token_ids for o in outputs] == expected[1]
    assert all(o.exit_depths == [1] * len(o.token_ids) for o in outputs)
    # mixed depths in one batch: each request equals its own depth's reference
    mixed = llm.generate(
        PROMPTS, [greedy(n, max_loops=1 + i % 2) for i, n in enumerate(MAX_TOKENS)]
    )
    assert [o.token_ids for o in mixed] == [expected[1 + i % 2][i] for i in range(len(PROMPTS))]


def test_hf_overrides_change_the_loop_count(engines, expected):
    llm = engines(hf_overrides={"num_loops": 3})
    assert llm.engine.model_info().num_loops == 3
    assert [o.token_ids for o in generate(llm)] == expected[3]


def test_batched_equals_serial_and_prefix_hits_equal_misses(engines, expected):
    llm = engines(enable_prefix_caching=True)
    serial = [
        generate(llm, [p], [n])[0].token_ids for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    assert serial == expected[2]
    again = generate(llm)  # every prompt's full pages are cached now
    assert [o.token_ids for o in again] == expected[2]
    hits = llm.get_stats().prefix_cache_hit_tokens
    assert hits > 0
    # a prompt run at one loop leaves other KV: it never takes the two-loop pages, and its own
    # pages serve the next one-loop request
    for _ in range(2):
        assert [o.token_ids for o in generate(llm, max_loops=1)] == expected[1]
    assert llm.get_stats().prefix_cache_hit_tokens > hits


def test_preemption_restores_exactly(engines, expected):
    tight = engines(num_kv_blocks=14, incremental_kv=True, enable_preemption=True, max_num_seqs=3)
    assert [o.token_ids for o in generate(tight)] == expected[2]
    assert tight.get_stats().preemptions > 0


def test_an_exit_threshold_is_refused_where_there_is_no_exit_signal(engines):
    llm = engines()
    with pytest.raises(InvalidRequestError, match="no exit signal"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, exit_threshold=0.5))
    with pytest.raises(ConfigurationError, match="gate"):
        engines(exit_policy="ouro")


def test_unknown_architectures_and_enabled_loop_options_fail_naming_them(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="OuroForCausalLM, NanbeigeForCausalLM"):
        LLM(bad, **ENGINE)
    for option, value in (("loop_share_kv", True), ("use_hyper_connections", True)):
        (bad / "config.json").write_text(json.dumps({**raw, option: value}))
        with pytest.raises(ModelConfigError, match=option):
            LLM(bad, **ENGINE)
    (bad / "config.json").write_text(json.dumps({**raw, "use_hyper_connections": False}))
    LLM(bad, **ENGINE).shutdown()  # a switched-off option loads


def test_served_over_http_with_per_token_depths(checkpoint):
    from serving_harness import run_server

    with run_server(checkpoint) as server, server.http() as http:
        body = {"prompt": [5, 17, 200, 3], "max_tokens": 4, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["exit_depths"] == [2, 2, 2, 2]  # no server-wide threshold applies
        refused = http.post("/v1/completions", json={**body, "exit_threshold": 0.5})
        assert refused.status_code == 400
        assert "no exit signal" in refused.json()["error"]["message"]
        server.wait_idle()


def test_rlt_serve_refuses_an_unsupported_architecture_naming_the_supported(checkpoint, tmp_path):
    import os
    import subprocess
    import sys
    import time

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    rlt = os.path.join(os.path.dirname(sys.executable), "rlt")
    started = time.monotonic()
    done = subprocess.run(
        [rlt, "serve", str(bad), "--device", "cpu", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert "GPT2LMHeadModel" in done.stderr and "NanbeigeForCausalLM" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 30  # the issue asks < 5 s on a quiet machine; this one may be shared


def test_a_tied_head_loads_whether_stored_or_not(tmp_path):
    import dataclasses

    from rlt_models import CheckpointError, load_model
    from safetensors.torch import save_file

    tied = write_random_checkpoint(
        tmp_path / "tied", dataclasses.replace(CONFIG, tie_word_embeddings=True), seed=5
    )
    weights = load_file(str(tied / "model.safetensors"))
    assert "lm_head.weight" not in weights  # as transformers' save_pretrained writes it
    model = load_model(tied)
    assert torch.equal(model.lm_head, weights["model.embed_tokens.weight"])
    llm = LLM(tied, **ENGINE)
    raw = json.loads((tied / "config.json").read_text())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    expected = [
        reference_greedy_from(weights, raw, p, n, 2)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    assert [o.token_ids for o in generate(llm)] == expected
    llm.shutdown()
    # stored and equal (the Hub's upload of a tied model): loads; stored and different: refused
    save_file(dict(weights), str(tied / "model.safetensors"))
    load_model(tied)
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1.0
    save_file(dict(weights), str(tied / "model.safetensors"))
    with pytest.raises(CheckpointError, match="differs"):
        load_model(tied)
