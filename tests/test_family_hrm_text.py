"""HRM-Text (nested H/L cycles, a two-vector state, gated attention, prefix-LM prompts) served
exactly: rlt's greedy tokens equal those of transformers' own `HrmTextForCausalLM.generate`
(the reference: its class wrote the checkpoint with `save_pretrained`), in fp32 on the CPU.

- prefix-LM on (the release): rlt makes the whole prompt one bidirectional block; transformers
  does so given token_type_ids of ones over the prompt. Off (`hf_overrides={"prefix_lm":
  false}`): a causal prompt, transformers without token_type_ids.
- loop counts from the config and from `hf_overrides` (H_cycles), batched against one request
  at a time in transformers, both scheduling modes; prompts larger than the step's token
  budget wait for a step of their own instead of being chunked.

The random weights use initializer_range 0.1 (embedding_scale 10), so the prompt mask changes
the tokens (checked: the two references differ); each reference step's top-2 logit gap must
exceed MARGIN (1e-4, far above fp32 rounding of these O(1) logits).
"""

from __future__ import annotations

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError

transformers = pytest.importorskip("transformers")

MARGIN = 1e-4
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 5, 6]
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hrm_text"))


def write_hf_checkpoint(out):
    """A tiny HRM-Text written by transformers' own class (`save_pretrained`) with a tokenizer."""
    from rlt_models.sample_text import SAMPLE_TEXT
    from rlt_models.tokenizer import save_hf_tokenizer, train_byte_level_bpe

    config = transformers.HrmTextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,  # per stack; transformers inflates it in the saved config
        num_attention_heads=4,
        head_dim=16,
        H_cycles=2,
        L_cycles=2,
        max_position_embeddings=256,
        eos_token_id=319,
        initializer_range=0.1,
        prefix_lm=True,
    )
    torch.manual_seed(0)
    model = transformers.HrmTextForCausalLM(config).eval()
    with torch.no_grad():
        model.model.z_L_init.normal_(0.0, 1.0)  # a learned vector; zero at init
    model.save_pretrained(out)
    tokenizer = train_byte_level_bpe(SAMPLE_TEXT.splitlines(), vocab_size=320)
    save_hf_tokenizer(tokenizer, out, model_max_length=256)
    return out


def reference(path, *, prefix_lm: bool, **overrides):
    """transformers' greedy tokens of each prompt, one request at a time."""
    model = transformers.HrmTextForCausalLM.from_pretrained(path, **overrides).eval()
    results = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = torch.tensor([prompt])
        extra = {"token_type_ids": torch.ones_like(ids)} if prefix_lm else {}
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                **extra,
            )
        for scores in out.scores:
            top = scores[0].topk(2).values
            assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        results.append(out.sequences[0, len(prompt) :].tolist())
    return results


def generate(llm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.core.leak_report() == []
    return [o.token_ids for o in outputs], [o.exit_depths for o in outputs]


@pytest.fixture(scope="module")
def expected(hf_model_dir):
    return {
        "prefix_lm": reference(hf_model_dir, prefix_lm=True),
        "causal": reference(hf_model_dir, prefix_lm=False),
        "one_cycle": reference(hf_model_dir, prefix_lm=True, H_cycles=1),
    }


def test_the_prompt_mask_matters(expected):
    assert expected["prefix_lm"] != expected["causal"]


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_prefix_lm_prompts_equal_transformers(hf_model_dir, expected, mode):
    # a token budget below the longest prompt: prompts wait for a step of their own, never
    # split (the engine raises the budget to the context length and logs it)
    with LLM(hf_model_dir, scheduling_mode=mode, max_num_batched_tokens=8, **ENGINE) as llm:
        info = llm.engine.model_info()
        assert (info.family, info.num_loops, info.exit_signal) == ("hrm_text", 2, "none")
        tokens, depths = generate(llm)
    assert tokens == expected["prefix_lm"]
    assert all(d == [2] * len(d) for d in depths)


def test_causal_prompts_equal_transformers(hf_model_dir, expected):
    with LLM(
        hf_model_dir, hf_overrides={"prefix_lm": False}, prefill_chunk_size=3, **ENGINE
    ) as llm:
        tokens, _ = generate(llm)  # causal prompts may be chunked (3 tokens a step here)
    assert tokens == expected["causal"]


def test_the_loop_count_from_hf_overrides(hf_model_dir, expected):
    with LLM(hf_model_dir, hf_overrides={"H_cycles": 1}, **ENGINE) as llm:
        tokens, depths = generate(llm)
    assert tokens == expected["one_cycle"]
    assert all(d == [1] * len(d) for d in depths)


def test_features_the_family_declares_unsupported_are_refused(hf_model_dir):
    for option, value in (("enable_prefix_caching", True), ("kv_layout", "shared")):
        with pytest.raises(ConfigurationError, match="hrm_text"):
            LLM(hf_model_dir, **{**ENGINE, option: value})


def test_served_over_http(hf_model_dir, expected):
    from serving_harness import run_server

    with run_server(hf_model_dir) as server, server.http() as http:
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS[0], "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["exit_depths"] == [2] * MAX_TOKENS[0]
        # echo with logprobs scores the prompt: refused for a prefix-LM prompt, with the reason
        echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})
        assert echo.status_code == 400, echo.text
        assert "prefix-LM" in echo.json()["error"]["message"]
        # the same prompt through the tokenizer round trip is not assumed: compare token ids
        ids = http.post("/tokenize", json={"prompt": choice["text"]}).json()
        assert ids["count"] >= 1
        server.wait_idle()


def test_preemption_restores_the_two_vector_state_exactly(hf_model_dir, expected):
    """A pool too small for all three: requests are preempted to CPU snapshots (their [z_H,
    z_L] rows and KV) and resumed; the tokens are transformers' still."""
    tight = dict(ENGINE, num_kv_blocks=16, incremental_kv=True, enable_preemption=True)
    with LLM(hf_model_dir, **tight) as llm:
        tokens, _ = generate(llm)
        assert llm.get_stats().preemptions > 0
    assert tokens == expected["prefix_lm"]
