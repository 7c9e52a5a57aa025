"""Dory (nGPT prelude / recurrent / coda sections, sliding windows, per-loop or last-loop KV,
elastic depth) served exactly: rlt's greedy tokens equal those of transformers' own
`DoryForCausalLM.generate` (the reference: its class wrote the checkpoint with
`save_pretrained`), in fp32 on the CPU.

- `per_loop` KV (the release): transformers' cached generation equals its full forward here
  (checked once below), so its `generate` is the reference; loop counts from the config, from
  `hf_overrides` (n_recurrent_loops) and from the request (`max_loops` 1 .. the engine's cap).
- `last_loop` KV (`hf_overrides={"recurrent_kv_cache_mode": "last_loop"}`): earlier loops read
  the past's last-loop keys and their own; transformers' cached `generate` defines it.
- the sliding window is 4 positions on every layer but every 4th, and prompts run past it.

The checkpoint's learned nGPT scales are drawn away from their init values (a bug in any of
them changes the tokens), and each reference step's top-2 logit gap must exceed MARGIN (1e-5,
far above fp32 rounding of these logits, whose magnitudes are about 0.1-1).
"""

from __future__ import annotations

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError

transformers = pytest.importorskip("transformers")

MARGIN = 1e-5
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 5, 6]
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("dory"))


def write_hf_checkpoint(out):
    """A tiny Dory written by transformers' own class (`save_pretrained`) with a tokenizer."""
    from rlt_models.sample_text import SAMPLE_TEXT
    from rlt_models.tokenizer import save_hf_tokenizer, train_byte_level_bpe

    config = transformers.DoryConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        n_input_layers=2,
        n_output_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=4,
        n_recurrent_loops=2,
        eos_token_id=319,
        ngpt_alpha_init=0.4,  # large residual rates: every loop and KV mode shows in the tokens
    )
    torch.manual_seed(0)
    model = transformers.DoryForCausalLM(config).eval()
    with torch.no_grad():  # learned scales away from their init
        for name, param in model.named_parameters():
            if any(k in name for k in ("sqk", "s_gate", "suv_", "lambda_", "logit_scale")):
                param.mul_(0.5 + torch.rand_like(param))
    model.save_pretrained(out)
    tokenizer = train_byte_level_bpe(SAMPLE_TEXT.splitlines(), vocab_size=320)
    save_hf_tokenizer(tokenizer, out, model_max_length=256)
    return out


def reference(path, **overrides):
    """transformers' greedy tokens of each prompt, one request at a time (cached generate)."""
    model = transformers.DoryForCausalLM.from_pretrained(path, **overrides).eval()
    results = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        for scores in out.scores:
            top = scores[0].topk(2).values
            assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        results.append(out.sequences[0, len(prompt) :].tolist())
    return results


def full_forward_greedy(path, prompt, n, **overrides):
    """Greedy tokens by a full forward over the whole sequence for every token (no cache)."""
    model = transformers.DoryForCausalLM.from_pretrained(path, **overrides).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def expected(hf_model_dir):
    return {loops: reference(hf_model_dir, n_recurrent_loops=loops) for loops in (1, 2, 3, 4)} | {
        "last_loop": reference(hf_model_dir, recurrent_kv_cache_mode="last_loop"),
        "no_window": reference(hf_model_dir, sliding_window=64),
    }


def generate(llm, max_loops=None):
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, max_loops=max_loops) for n in MAX_TOKENS
    ]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.core.leak_report() == []
    return [o.token_ids for o in outputs], [o.exit_depths for o in outputs]


def test_per_loop_cached_generation_is_the_full_forward(hf_model_dir, expected):
    assert full_forward_greedy(hf_model_dir, PROMPTS[2], MAX_TOKENS[2]) == expected[2][2]
    assert expected[2] != expected[3] != expected[1]  # the loop count changes the tokens
    assert expected["last_loop"] != expected[2]  # and the KV mode
    assert expected["no_window"] != expected[2]  # and the sliding window


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    with LLM(hf_model_dir, prefill_chunk_size=3, **ENGINE) as llm:
        yield llm


def test_tokens_equal_transformers_at_every_depth_to_the_cap(llm, expected):
    info = llm.engine.model_info()
    assert (info.family, info.exit_signal) == ("dory", "none")
    for loops in (1, 2, 3, 4):  # elastic depth: the cap is twice the checkpoint's 2 loops
        tokens, depths = generate(llm, max_loops=loops)
        assert tokens == expected[loops], loops
        assert all(d == [loops] * len(d) for d in depths)


def test_a_request_without_max_loops_runs_the_checkpoint_depth(llm, expected):
    tokens, depths = generate(llm)
    assert tokens == expected[2]
    assert all(d == [2] * len(d) for d in depths)


def test_mixed_depths_in_one_batch_equal_serial(llm, expected):
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, max_loops=loops)
        for n, loops in zip(MAX_TOKENS, (1, 4, 3), strict=True)
    ]
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [expected[1][0], expected[4][1], expected[3][2]]
    assert llm.engine.core.leak_report() == []


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_scheduling_modes_and_the_loop_count_from_hf_overrides(hf_model_dir, expected, mode):
    with LLM(
        hf_model_dir, hf_overrides={"n_recurrent_loops": 3}, scheduling_mode=mode, **ENGINE
    ) as llm:
        tokens, depths = generate(llm, max_loops=3)
    assert tokens == expected[3]


def test_last_loop_kv_equals_transformers_cached_generate(hf_model_dir, expected):
    overrides = {"recurrent_kv_cache_mode": "last_loop"}
    with LLM(hf_model_dir, hf_overrides=overrides, max_num_batched_tokens=8, **ENGINE) as llm:
        tokens, _ = generate(llm, max_loops=2)
    assert tokens == expected["last_loop"]


def test_prefix_hits_equal_misses(hf_model_dir, expected):
    with LLM(hf_model_dir, enable_prefix_caching=True, **ENGINE) as llm:
        first, _ = generate(llm, max_loops=2)
        again, _ = generate(llm, max_loops=2)
        assert llm.get_stats().prefix_cache_hit_tokens > 0
        other_depth, _ = generate(llm, max_loops=3)  # the coda's KV depends on the loops
    assert first == again == expected[2]
    assert other_depth == expected[3]


def test_preemption_restores_exactly(hf_model_dir, expected):
    tight = dict(ENGINE, num_kv_blocks=24, incremental_kv=True, enable_preemption=True)
    with LLM(hf_model_dir, **tight) as llm:
        tokens, _ = generate(llm, max_loops=2)
        assert llm.get_stats().preemptions > 0
    assert tokens == expected[2]


def test_features_the_family_declares_unsupported_are_refused(hf_model_dir):
    for option, value in (("kv_layout", "shared"), ("num_speculative_tokens", 2)):
        with pytest.raises(ConfigurationError, match="dory"):
            LLM(hf_model_dir, **{**ENGINE, option: value})
    with pytest.raises(ConfigurationError, match="last_loop"):
        LLM(
            hf_model_dir,
            hf_overrides={"recurrent_kv_cache_mode": "last_loop"},
            enable_prefix_caching=True,
            **ENGINE,
        )


def test_hub_layout_checkpoint_loads(hf_model_dir, tmp_path):
    """The Hub's names (`backbone.*`, attention and MLP blocks as layers 2i and 2i + 1,
    `attn_alpha` / `mlp_alpha`, `g_proj`) load to the same model."""
    import json
    import shutil

    from rlt_models.loading import load_model
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_model_dir / "model.safetensors"))
    hub = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[1] == "layers":
            i, rest = int(parts[2]), parts[3:]
            if rest[0] in ("lambda_1", "lambda_2"):
                block = 2 * i + (rest[0] == "lambda_2")
                name = f"backbone.layers.{block}.{'attn_alpha' if block % 2 == 0 else 'mlp_alpha'}"
            else:
                block = 2 * i + (rest[0] == "mlp")
                tail = ".".join(rest[1:]).replace("gate_proj", "g_proj", rest[0] == "self_attn")
                name = f"backbone.layers.{block}.mixer.{tail}"
        hub[name] = tensor
    save_file(hub, str(tmp_path / "model.safetensors"))
    shutil.copy(hf_model_dir / "config.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 12
    ours = load_model(hf_model_dir, dtype="float32").state_dict()
    theirs = load_model(tmp_path, dtype="float32").state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_served_over_http(hf_model_dir):
    from serving_harness import run_server

    with run_server(hf_model_dir) as server, server.http() as http:
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS[0], "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["exit_depths"] == [2] * MAX_TOKENS[0]
        deep = http.post("/v1/completions", json={**body, "max_loops": 4})
        assert deep.status_code == 200, deep.text
        assert deep.json()["choices"][0]["exit_depths"] == [4] * MAX_TOKENS[0]
        server.wait_idle()


def test_prompt_logprobs_equal_transformers(llm, hf_model_dir):
    """Prompt scoring reads the coda's output at every prompt position (chunks of 3 here)."""
    model = transformers.DoryForCausalLM.from_pretrained(hf_model_dir).eval()
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True, max_loops=2)
    for prompt in PROMPTS:
        out = llm.generate([prompt], scored)[0]
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = [float(logprobs[i, t]) for i, t in enumerate(prompt[1:])]
        assert out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert llm.engine.core.leak_report() == []


def test_an_engine_cap_above_the_default(hf_model_dir, expected):
    from rlt_contracts import InvalidRequestError

    with LLM(hf_model_dir, max_model_loops=3, **ENGINE) as llm:
        assert llm.engine.model_info().num_loops == 3
        tokens, _ = generate(llm)
        deep, _ = generate(llm, max_loops=3)
        with pytest.raises(InvalidRequestError, match="max-model-loops"):
            generate(llm, max_loops=4)
    assert (tokens, deep) == (expected[2], expected[3])


def test_scoring_at_exit_depth_is_refused_per_request(llm):
    """The family declares exit-depth scoring unsupported (its prelude and coda are not run by
    that path): a request asking for it is a 400-class error, and the engine keeps serving."""
    from rlt_contracts import InvalidRequestError

    asked = SamplingParams(max_tokens=2, prompt_logprobs=1, score_at_exit_depth=True)
    with pytest.raises(InvalidRequestError, match="dory") as refused:
        llm.generate([PROMPTS[0]], asked)
    assert refused.value.field == "score_at_exit_depth"
    tokens, _ = generate(llm, max_loops=2)
    assert llm.engine.core.leak_report() == []


def test_prefill_decode_pair_equals_one_engine(hf_model_dir, expected):
    """PD over the loopback port: the prompt's KV of every plane (the loop planes and the
    stage plane with the prelude's and coda's KV) and its final state go to the decode side,
    whose tokens are a single engine's (transformers')."""
    from family_feature_checks import pd_outputs

    def make(**options):
        return LLM(hf_model_dir, **{**ENGINE, **options})

    params = [SamplingParams(max_tokens=n, ignore_eos=True, max_loops=2) for n in MAX_TOKENS]
    outputs, pair, engines = pd_outputs(make, PROMPTS, params, nixl=False)
    try:
        assert [o.token_ids for o in outputs] == expected[2]
        assert pair.written == {f"t{i}": len(p) for i, p in enumerate(PROMPTS)}
        assert all(llm.engine.core.leak_report() == [] for llm in engines)
    finally:
        for llm in engines:
            llm.shutdown()
