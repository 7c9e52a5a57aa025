"""Huginn-0125 (`RavenForCausalLM`: 2 prelude + 4 recurrent + 2 coda sandwich blocks, an adapter
on cat[state, prelude output], q/k bias before pair-wise RoPE, ln_f used twice, a tied head)
served at fixed depth exactly: rlt's greedy tokens equal a dense float64 reference written here
from the authors' math (model-families.md section 4; transformers has no Huginn class, and the
reference shares no code with rlt-models), with the zero initial state.

KV semantics the reference encodes: a query at step k reads step k's keys of every earlier
position (each position of a request runs the request's steps, prompt included, no exits), and
the prelude's and coda's layers one KV each per position; with one depth per sequence this is
the whole sequence recomputed for every token, which is what the reference does.

Covered: the config's default depth (mean_recurrence 4), a request's `max_loops` below and above
it up to the engine's cap (8 = twice the default), `hf_overrides={"mean_recurrence": 3}` (cap 6)
in both scheduling modes, mixed depths batched equal serial, chunked prefill (chunks of 5,
16-token budget) and prefix caching (hits equal misses, depths kept apart), preemption, no KV
leak after any run, the Hub's checkpoint layout (head and RoPE table stored or not, shards,
bf16), config.json as the authors ship it, refused options, and one HTTP request.

Conditioning: weights are drawn with std 0.1. At the writer's default 0.02 the state barely
depends on the step count and some greedy steps tie within 3e-5; at 0.2 the recurrence is
chaotic (a relative 1e-7 change of the weights, about fp32 rounding, moves the logits by 1.0
after 8 steps, so fp32 cannot follow fp64); at 0.1 the same change moves them by about 2e-6 at
every depth up to 8. Each reference step's top-2 logit gap must exceed MARGIN (1e-4), so equal
tokens are expected, not luck.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError, InvalidRequestError, StagePlan
from rlt_models import (
    CheckpointError,
    ModelConfigError,
    RandomInit,
    load_model,
    write_random_checkpoint,
)
from rlt_models.huginn_config import HuginnConfig
from safetensors.torch import load_file, save_file

MARGIN = 1e-4
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 5, 6]
DEFAULT, CAP = 4, 8
CONFIG = HuginnConfig(
    vocab_size=320,
    n_embd=64,
    n_heads=4,
    n_layers_in_prelude=2,
    n_layers_in_recurrent_block=4,
    n_layers_in_coda=2,
    intermediate_size=96,
    mean_recurrence=DEFAULT,
    block_size=256,
    eos_token_id=(319,),
)
INIT = RandomInit(weight_std=0.1)
ENGINE = dict(
    initial_state="zero",  # the reference's default; the like-init draw: its own tests below
    dtype="float32",
    device="cpu",
    block_size=4,
    num_kv_blocks=512,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=5,
)
# config.json of tomg-group-umd/huginn-0125 as the authors' RavenConfig saved it
HUB_CONFIG = {
    "activation_checkpoint_impl": "per-iteration",
    "architecture_class_name": "RecurrentGPT",
    "architectures": ["RavenForCausalLM"],
    "auto_map": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "bias": False,
    "block_class_name": "SandwichBlock",
    "block_size": 4096,
    "bos_token_id": 65504,
    "effective_expected_depth": 132,
    "eos_token_id": 65505,
    "head_dim": 96,
    "init_orthogonal": False,
    "init_strategy": "takase",
    "init_values": {
        "embed_scale": 72.6636084983398,
        "embedding": 0.008703882797784892,
        "out_proj": 0.0005356869554443541,
        "std": 0.008703882797784892,
    },
    "injection_type": "linear",
    "intermediate_size": 17920,
    "mean_backprop_depth": 8,
    "mean_recurrence": 32,
    "mlp_class_name": "GatedMLP",
    "model_type": "huginn_raven",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_coda": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "norm_eps": 1e-06,
    "num_key_value_heads": 55,
    "pad_token_id": 65509,
    "padded_vocab_size": 65536,
    "padding_multiple": 4096,
    "qk_bias": True,
    "rope_base": 50000,
    "sampling_scheme": "poisson-lognormal-filling",
    "state_init": "like-init",
    "tie_embeddings": True,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "transformers_version": "4.44.2",
    "vocab_size": 65536,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("huginn"), CONFIG, seed=3, init=INIT)


# -- the dense reference (float64, the whole sequence recomputed for every token) -------------
def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_pairs(x, positions, base):  # x [n, heads, d]: (x[2j], x[2j + 1]) rotated by angle j
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def like_init_state(seed, n, d):
    """The like-init initial state of positions 0..n-1 of a request with `seed`, float64: the
    authors' truncated normal (std sqrt(2 / (5d)), cut at 3 std, times sqrt(d)) by the inverse
    CDF of rlt's per-(seed, position) uniforms (the stream is rlt's definition; the transform
    is written here)."""
    from rlt_sampling.noise import STATE_DOMAIN, counter_uniform

    u = counter_uniform(
        torch.full((n,), seed, dtype=torch.int64), torch.arange(n), d, domain=STATE_DOMAIN
    ).double()
    edge = 0.5 * math.erfc(3 / math.sqrt(2))
    standard = math.sqrt(2) * torch.erfinv(2 * (edge + u * (1 - 2 * edge)) - 1)
    return standard * math.sqrt(2 / (5 * d)) * math.sqrt(d)


def reference_logits(weights, raw, ids, steps, seed=None):
    """Logits of every position of `ids`, each position run `steps` recurrent steps, from the
    zero initial state (seed None) or the like-init state of the request's `seed`."""
    w = {k: v.double() for k, v in weights.items()}
    d, heads, eps = raw["n_embd"], raw["n_heads"], raw["norm_eps"]
    head_dim, f, n = d // heads, raw["intermediate_size"], len(ids)
    positions = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def block(p, x):  # the sandwich block
        h = _rms(x, w[f"{p}.norm_1.weight"], eps)
        q, k, v = (
            t.reshape(n, heads, head_dim) for t in (h @ w[f"{p}.attn.Wqkv.weight"].T).split(d, -1)
        )
        if raw["qk_bias"]:  # before RoPE
            q, k = q + w[f"{p}.attn.qk_bias"][0, 0], k + w[f"{p}.attn.qk_bias"][1, 0]
        q, k = (
            _rope_pairs(q, positions, raw["rope_base"]),
            _rope_pairs(k, positions, raw["rope_base"]),
        )
        scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, d)
        x = _rms(x + attn @ w[f"{p}.attn.proj.weight"].T, w[f"{p}.norm_2.weight"], eps)
        gate, up = (_rms(x, w[f"{p}.norm_3.weight"], eps) @ w[f"{p}.mlp.fc.weight"].T).split(f, -1)
        mlp = (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.proj.weight"].T
        return _rms(x + mlp, w[f"{p}.norm_4.weight"], eps)

    embed = w["transformer.wte.weight"]
    e = embed[torch.tensor(ids)] * raw["init_values"]["embed_scale"]
    for i in range(raw["n_layers_in_prelude"]):
        e = block(f"transformer.prelude.{i}", e)
    s = torch.zeros_like(e) if seed is None else like_init_state(seed, n, d)
    for _ in range(steps):
        s = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T  # state first
        for i in range(raw["n_layers_in_recurrent_block"]):
            s = block(f"transformer.core_block.{i}", s)
    x = _rms(s, w["transformer.ln_f.weight"], eps)
    for i in range(raw["n_layers_in_coda"]):
        x = block(f"transformer.coda.{i}", x)
    x = _rms(x, w["transformer.ln_f.weight"], eps)  # ln_f again
    return x @ w.get("lm_head.weight", embed).T


def reference_greedy(path, prompt, max_tokens, steps, seed=None):
    weights = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = reference_logits(weights, raw, ids, steps, seed)[-1]
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def reference_all(path, steps):
    return [reference_greedy(path, p, n, steps) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {steps: reference_all(checkpoint, steps) for steps in (2, 3, DEFAULT, 6, CAP)}


# -- the engine -----------------------------------------------------------------------------
def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, **params):
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **params) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    assert llm.engine.core.leak_report() == []
    return outputs


def tokens(outputs):
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(checkpoint):
    """One engine shared by the cases, prefix caching on: each case also checks that cached
    pages of one depth never serve another."""
    with LLM(checkpoint, enable_prefix_caching=True, **ENGINE) as llm:
        yield llm


def test_the_reference_depends_on_every_depth(expected):
    runs = [expected[steps] for steps in sorted(expected)]
    assert all(a != b for i, a in enumerate(runs) for b in runs[i + 1 :])


def test_declaration_and_model_info(llm):
    info = llm.engine.model_info()
    assert (info.family, info.exit_signal) == ("huginn", "latent_change")
    assert (info.default_loops, info.num_loops) == (DEFAULT, CAP)
    declared = llm.engine.core.runner.model.family
    assert declared.stages == StagePlan(core_layers=4, prelude_layers=2, coda_layers=2)
    assert declared.state == ("state", "prelude_output")
    assert (declared.kv.layers_per_plane, declared.kv.stage_layers) == (4, 4)
    assert llm.engine.core.kv.num_planes == CAP + 1  # a plane per step, then the stage plane


def test_tokens_equal_the_reference_at_the_configs_depth(llm, expected):
    outputs = generate(llm)
    assert tokens(outputs) == expected[DEFAULT]
    assert all(o.exit_depths == [DEFAULT] * len(o.token_ids) for o in outputs)


@pytest.mark.parametrize("steps", [2, 6, CAP])
def test_a_request_runs_its_max_loops_below_and_above_the_default(llm, expected, steps):
    outputs = generate(llm, max_loops=steps)
    assert tokens(outputs) == expected[steps]
    assert all(o.exit_depths == [steps] * len(o.token_ids) for o in outputs)


def test_one_request_runs_the_prelude_coda_and_head_only_in_the_ticks_that_need_them(
    llm, expected, monkeypatch
):
    """A decode tick tells the stages and the head (`needed`, a device flag) whether any row
    runs them: at one request the prelude runs in a token's first step and the coda and head
    in its last, so their weights are read once per token, not once per step (on CUDA the
    small-batch kernels skip the read; here the flags are checked)."""
    model = llm.engine.core.runner.model
    flags = {"embed": [], "finish": [], "coda": []}

    def recorded(name):
        original = getattr(model, name)

        def call(*args, needed=None, **kwargs):
            if needed is not None:  # decode ticks (prefill and token 0 pass none)
                flags[name].append(int(needed.item()))
            return original(*args, needed=needed, **kwargs)

        return call

    for name in flags:
        monkeypatch.setattr(model, name, recorded(name))
    [output] = generate(llm, prompts=PROMPTS[:1], max_tokens=[5])
    assert output.token_ids == expected[DEFAULT][0][:5]
    steps = [1] + [0] * (DEFAULT - 1)
    ticks = 4 * DEFAULT  # tokens 1-4, DEFAULT steps each; a step may queue idle ticks after
    assert flags["embed"][:ticks] == steps * 4
    assert flags["finish"][:ticks] == flags["coda"][:ticks] == steps[::-1] * 4
    assert not any(flags["embed"][ticks:] + flags["finish"][ticks:] + flags["coda"][ticks:])


def test_the_fused_path_equals_the_eager_one(llm, expected, monkeypatch):
    """The fused block (small-batch projections, one-kernel norms and SwiGLU product: on by
    default on CUDA) with its "torch" impl: the eager numerics exactly, so the same tokens."""
    monkeypatch.setattr(llm.engine.core.runner.model, "fused_path", "torch")
    outputs = generate(llm, max_loops=3)
    assert tokens(outputs) == expected[3]


def test_beyond_the_cap_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="max_loops"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, max_loops=CAP + 1))


def test_batched_mixed_depths_equal_serial_and_prefix_hits_equal_misses(llm, expected):
    serial = [tokens(generate(llm, [p], [n]))[0] for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    assert serial == expected[DEFAULT]
    hits = llm.get_stats().prefix_cache_hit_tokens
    assert tokens(generate(llm)) == expected[DEFAULT]  # every prompt's full pages are cached
    assert llm.get_stats().prefix_cache_hit_tokens > hits
    depths = (2, CAP, 3)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, max_loops=steps)
        for n, steps in zip(MAX_TOKENS, depths, strict=True)
    ]
    mixed = llm.generate(PROMPTS, params)
    assert tokens(mixed) == [expected[steps][i] for i, steps in enumerate(depths)]
    assert llm.engine.core.leak_report() == []


def test_prompt_logprobs_equal_the_reference(llm, checkpoint):
    """Prompt scoring reads the coda's output at every prompt position (chunks of 5 here)."""
    weights = load_file(str(checkpoint / "model.safetensors"))
    raw = json.loads((checkpoint / "config.json").read_text())
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True, max_loops=6)
    for prompt in PROMPTS:
        out = llm.generate([prompt], scored)[0]
        logprobs = reference_logits(weights, raw, prompt, 6).log_softmax(-1)
        want = [float(logprobs[i, t]) for i, t in enumerate(prompt[1:])]
        assert out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert llm.engine.core.leak_report() == []


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_hf_overrides_set_the_default_depth_in_both_scheduling_modes(checkpoint, expected, mode):
    with LLM(
        checkpoint, hf_overrides={"mean_recurrence": 3}, scheduling_mode=mode, **ENGINE
    ) as llm:
        info = llm.engine.model_info()
        assert (info.default_loops, info.num_loops) == (3, 6)  # the cap: twice the default
        outputs = generate(llm)
        assert tokens(outputs) == expected[3]
        assert all(o.exit_depths == [3] * len(o.token_ids) for o in outputs)
        assert tokens(generate(llm, max_loops=6)) == expected[6]


def test_preemption_restores_exactly(checkpoint, expected):
    tight = dict(ENGINE, num_kv_blocks=54, incremental_kv=True, enable_preemption=True)
    with LLM(checkpoint, **tight) as llm:
        assert tokens(generate(llm)) == expected[DEFAULT]
        assert llm.get_stats().preemptions > 0


def test_features_the_family_declares_unsupported_are_refused(checkpoint):
    for option, value in (("kv_layout", "shared"), ("num_speculative_tokens", 2)):
        with pytest.raises(ConfigurationError, match="huginn"):
            LLM(checkpoint, **{**ENGINE, option: value})


# -- checkpoints and config.json --------------------------------------------------------------
def test_the_hub_layout_loads_with_or_without_the_head_and_rope_table(checkpoint, tmp_path):
    """The Hub stores `lm_head.weight` (equal to the embedding) and `freqs_cis` in shards;
    `save_pretrained`-style checkpoints may leave either out. All load to the same model."""
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert "lm_head.weight" not in weights and "freqs_cis" in weights
    assert weights["freqs_cis"].shape == (1, CONFIG.block_size, 1, CONFIG.head_dim // 2, 2)
    reference = load_model(checkpoint).state_dict()

    def variant(name, tensors, shards=1):
        out = tmp_path / name
        out.mkdir()
        for file in checkpoint.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, out / file.name)
        names = sorted(tensors)
        size = math.ceil(len(names) / shards)
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k].contiguous() for k in names[i * size : (i + 1) * size]}
            save_file(part, str(out / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        return out

    hub = dict(weights, **{"lm_head.weight": weights["transformer.wte.weight"].clone()})
    bare = {k: v for k, v in weights.items() if k != "freqs_cis"}
    for path in (variant("hub", hub, shards=4), variant("bare", bare)):
        loaded = load_model(path).state_dict()
        assert loaded.keys() == reference.keys()
        assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    with LLM(variant("hub_engine", hub, shards=4), **ENGINE) as llm:
        assert tokens(generate(llm, PROMPTS[:1], MAX_TOKENS[:1])) == [
            reference_greedy(checkpoint, PROMPTS[0], MAX_TOKENS[0], DEFAULT)
        ]
    wrong_head = dict(hub, **{"lm_head.weight": hub["lm_head.weight"] + 1.0})
    with pytest.raises(CheckpointError, match="differs"):
        load_model(variant("wrong_head", wrong_head))
    # a split-half table (cos, sin of the other rotation) is not what config.json defines
    table = weights["freqs_cis"]
    halves = torch.cat([table[..., ::2, :], table[..., 1::2, :]], dim=3)
    with pytest.raises(CheckpointError, match="freqs_cis"):
        load_model(variant("wrong_rope", dict(weights, freqs_cis=halves)))


def test_an_untied_head_and_bf16_shards(tmp_path):
    untied = dataclasses.replace(CONFIG, tie_embeddings=False)
    path = write_random_checkpoint(tmp_path / "untied", untied, seed=3, init=INIT)
    weights = load_file(str(path / "model.safetensors"))
    assert not torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    with LLM(path, **ENGINE) as llm:
        assert tokens(generate(llm)) == reference_all(path, DEFAULT)
    bf16 = write_random_checkpoint(
        tmp_path / "bf16", CONFIG, seed=3, init=INIT, dtype="bfloat16", max_shard_bytes=200_000
    )
    assert len(list(bf16.glob("model-*.safetensors"))) > 1
    stored = {}
    for shard in bf16.glob("model-*.safetensors"):
        stored.update(load_file(str(shard)))
    model = load_model(bf16, dtype="float32")
    assert model.dtype == torch.float32
    assert torch.equal(model.embed_tokens, stored["transformer.wte.weight"].float())
    assert torch.equal(model.adapter, stored["transformer.adapter.weight"].float())


def test_config_json_as_the_authors_ship_it():
    release = HuginnConfig.from_dict(HUB_CONFIG)
    assert release == dataclasses.replace(
        HuginnConfig(), embed_scale=72.6636084983398, torch_dtype="float32"
    )
    assert abs(release.scale - math.sqrt(5280)) < 1e-12
    assert release.shape().eos_token_ids == (65505, 65504, 65508)  # the authors' stops
    declared = release.declaration()
    assert (declared.default_loops, declared.max_loops, declared.loop_limit) == (32, 64, None)
    assert declared.stages.prelude_layers == declared.stages.coda_layers == 2
    assert release.shape().num_layers == 4 and release.shape().state_width == 2 * 5280
    # config.json states init_values' embed_scale, so it comes back explicit
    assert HuginnConfig.from_dict(CONFIG.to_dict()) == dataclasses.replace(CONFIG, embed_scale=8.0)
    written = CONFIG.to_dict()
    # every key but the remote-code map, the release's special ids and the writer's version
    assert set(HUB_CONFIG) - set(written) == {
        "auto_map",
        "bos_token_id",
        "pad_token_id",
        "transformers_version",
    }
    assert set(written) - set(HUB_CONFIG) == {"test_time_noise", "test_time_noise_type"}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("injection_type", "additive"),
        ("state_init", "normal"),
        ("test_time_noise", 0.1),
        ("num_key_value_heads", 5),
        ("head_dim", 128),
        ("tie_word_embeddings", False),
        ("mlp_class_name", "BaseMLP"),
        ("recurrent_embedding_dimension", 768),  # a later family's option: unknown, enabled
    ],
)
def test_options_rlt_does_not_implement_are_refused_by_name(key, value):
    with pytest.raises(ModelConfigError, match=key):
        HuginnConfig.from_dict({**HUB_CONFIG, key: value})


def test_the_like_init_state_is_drawn_per_request_seed_and_position(checkpoint):
    """initial_state="random" (the default): each token's s0 from its request's seed and its
    position, so tokens equal the reference's draw whatever the batch, chunking or
    preemption, and another seed gives other tokens."""
    want = {
        seed: [
            reference_greedy(checkpoint, p, n, DEFAULT, seed)
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        for seed in (0, 7)
    }
    assert want[0] != want[7] != expected_zero(checkpoint)
    random = {k: v for k, v in ENGINE.items() if k != "initial_state"}
    tight = dict(random, num_kv_blocks=48, incremental_kv=True, enable_preemption=True)
    with LLM(checkpoint, **tight) as llm:
        for seed in (0, 7):
            outputs = generate(llm, seed=seed)
            assert tokens(outputs) == want[seed]
            serial = [
                tokens(generate(llm, [p], [n], seed=seed))[0]
                for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
            ]
            assert serial == want[seed]
        assert llm.get_stats().preemptions > 0


def expected_zero(checkpoint):
    return [
        reference_greedy(checkpoint, p, n, DEFAULT)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def test_served_over_http(checkpoint):
    from serving_harness import run_server

    with run_server(checkpoint) as server, server.http() as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["exit_depths"] == [DEFAULT] * 4
        deep = http.post("/v1/completions", json={**body, "max_loops": CAP})
        assert deep.status_code == 200, deep.text
        assert deep.json()["choices"][0]["exit_depths"] == [CAP] * 4
        server.wait_idle()


@pytest.mark.parametrize("initial_state", ["zero", "random"])
def test_prefill_decode_pair_equals_one_engine(checkpoint, expected, initial_state):
    """PD over the loopback port: every plane's KV (steps and the stage plane) and the prompt's
    final state go to the decode side; with the like-init state the decode side draws each
    new token's state from the same (seed, position) stream, so its tokens are one engine's."""
    from family_feature_checks import pd_outputs

    options = {**ENGINE, "initial_state": initial_state}

    def make(**extra):
        return LLM(checkpoint, **{**options, **extra})

    params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=5) for n in MAX_TOKENS]
    if initial_state == "zero":
        want = expected[DEFAULT]
    else:
        with make() as llm:
            want = tokens(llm.generate(PROMPTS, params))
    outputs, pair, engines = pd_outputs(make, PROMPTS, params, nixl=False)
    try:
        assert tokens(outputs) == want
        assert all(llm.engine.core.leak_report() == [] for llm in engines)
    finally:
        for llm in engines:
            llm.shutdown()
