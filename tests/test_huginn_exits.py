"""Huginn-0125's convergence exits (`latent_diff`, `latent_diff_delayed`) served batched at loop
level exactly: rlt's greedy tokens AND exit depths equal a dense float64 reference, run one
request at a time, written here from the authors' rule (model-families.md section 4): after every
recurrent step k >= min_loops, a token exits when ||s_k - s_{k-1}|| / ||s_k|| < threshold
(s_0 the zero initial state); the delayed rule exits one step after the trigger; max_loops
always wins; the prompt and token 0 run max_loops steps with no exit.

KV the reference reads (rlt's `last_exited` layout, the authors' `latest-m4` prescription for
exits): a query at step k reads, of an earlier position that exited at e < k, its step-e keys
and values; the prelude and coda keep one KV per position (the coda's from the position's final
state).

Conditioning: each reference decision's latent change must differ from the threshold by more
than DECISION_MARGIN (1e-4, against fp32 rounding of about 1e-6 in these ratios), and each
greedy step's top-2 logit gap by more than MARGIN (1e-4), so equal tokens and depths are
expected, not luck.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import InvalidRequestError
from rlt_models import write_random_checkpoint
from safetensors.torch import load_file
from test_family_huginn import CONFIG, ENGINE, INIT, MARGIN, _rms, _rope_pairs

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 6, 6]
CAP = 8
DECISION_MARGIN = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("huginn"), CONFIG, seed=3, init=INIT)


class Reference:
    """The dense float64 model of one sequence whose positions have their own exit steps."""

    def __init__(self, path) -> None:
        self.w = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
        self.raw = json.loads((path / "config.json").read_text())

    def block(self, prefix, x, stored=None, keep=None):
        """A sandwich block over all positions; `stored` (K, V) replaces the keys and values
        of the positions `keep` (exited ones: their exit step's); returns (x', (K, V))."""
        w, raw = self.w, self.raw
        n, d, heads = x.shape[0], raw["n_embd"], raw["n_heads"]
        hd, f, eps = d // heads, raw["intermediate_size"], raw["norm_eps"]
        positions = torch.arange(n)
        h = _rms(x, w[f"{prefix}.norm_1.weight"], eps)
        q, k, v = (
            t.reshape(n, heads, hd) for t in (h @ w[f"{prefix}.attn.Wqkv.weight"].T).split(d, -1)
        )
        bias = w[f"{prefix}.attn.qk_bias"]
        q = _rope_pairs(q + bias[0, 0], positions, raw["rope_base"])
        k = _rope_pairs(k + bias[1, 0], positions, raw["rope_base"])
        if stored is not None:
            k = torch.where(keep[:, None, None], stored[0], k)
            v = torch.where(keep[:, None, None], stored[1], v)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        attn = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v
        )
        x = _rms(
            x + attn.reshape(n, d) @ w[f"{prefix}.attn.proj.weight"].T,
            w[f"{prefix}.norm_2.weight"],
            eps,
        )
        gate, up = (
            _rms(x, w[f"{prefix}.norm_3.weight"], eps) @ w[f"{prefix}.mlp.fc.weight"].T
        ).split(f, -1)
        x = _rms(
            x + (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.proj.weight"].T,
            w[f"{prefix}.norm_4.weight"],
            eps,
        )
        return x, (k, v)

    def run(self, ids, depths, rule, *, states=False):
        """Logits of the last position and its exit step (`states`: every position's final
        state instead). `depths`: the exit steps of every position but the last; the last
        one's is decided by `rule` (threshold, min_loops, max_loops, delayed, measure), or is
        `rule`'s max_loops when the threshold is None."""
        threshold, min_loops, max_loops, delayed, measure = rule
        if measure == "kl":  # the coda reads earlier positions' final states (its KV)
            earlier = self.run(ids, depths, (None, 1, max_loops, False, "latent"), states=True)
        w, raw = self.w, self.raw
        e = w["transformer.wte.weight"][torch.tensor(ids)] * raw["init_values"]["embed_scale"]
        for i in range(raw["n_layers_in_prelude"]):
            e, _ = self.block(f"transformer.prelude.{i}", e)
        s = torch.zeros_like(e)
        stored = [None] * raw["n_layers_in_recurrent_block"]
        last_exit, pending, changes, previous = None, None, [], None
        for step in range(1, max_loops + 1):
            known = torch.tensor([step <= d for d in depths] + [last_exit is None])
            x = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T
            for i in range(raw["n_layers_in_recurrent_block"]):
                x, kv = self.block(f"transformer.core_block.{i}", x, stored[i], ~known)
                stored[i] = kv  # exited positions keep their exit step's (replaced above)
            if last_exit is None:
                if measure == "kl":  # the coda and head on the state after this step
                    now = torch.cat([earlier[:-1], x[-1:]])
                    logprobs = self.head(now)[-1].log_softmax(-1)
                    previous = (
                        torch.full_like(logprobs, -math.log(len(logprobs)))
                        if previous is None
                        else previous
                    )
                    change = float((previous.exp() * (previous - logprobs)).sum())
                    previous = logprobs
                else:
                    change = float((x[-1] - s[-1]).norm() / x[-1].norm())
                changes.append(change)
                triggered = threshold is not None and step >= min_loops and change < threshold
                if threshold is not None and step >= min_loops:
                    assert abs(change - threshold) > DECISION_MARGIN, "ill-conditioned decision"
                if step == max_loops or (pending is not None and step >= pending):
                    last_exit = step
                elif triggered and not delayed:
                    last_exit = step
                elif triggered and pending is None:
                    pending = step + 1
            s = torch.where(known[:, None], x, s)
            if not known.any():
                break
        return s if states else (self.head(s)[-1], last_exit)

    def head(self, s):
        """Logits of every position from the final states `s` (ln_f, the coda, ln_f, head)."""
        w, eps = self.w, self.raw["norm_eps"]
        x = _rms(s, w["transformer.ln_f.weight"], eps)
        for i in range(self.raw["n_layers_in_coda"]):
            x, _ = self.block(f"transformer.coda.{i}", x)
        x = _rms(x, w["transformer.ln_f.weight"], eps)
        return x @ w.get("lm_head.weight", w["transformer.wte.weight"]).T

    def greedy(
        self,
        prompt,
        max_tokens,
        threshold,
        *,
        min_loops=1,
        max_loops=CAP,
        delayed=False,
        measure="latent",
    ):
        """(tokens, exit depths) of one request: the prompt at max_loops, then each token at
        its rule's exit step."""
        ids, depths, out, out_depths = list(prompt), [max_loops] * (len(prompt) - 1), [], []
        rule = (None, min_loops, max_loops, delayed, measure)
        for _ in range(max_tokens):
            logits, depth = self.run(ids, depths, rule)
            top = logits.topk(2).values
            assert top[0] - top[1] > MARGIN, "ill-conditioned case"
            out.append(int(logits.argmax()))
            out_depths.append(depth)
            depths.append(depth)
            ids.append(out[-1])
            rule = (threshold, min_loops, max_loops, delayed, measure)  # token 0: no exits
        return out, out_depths


THRESHOLD = 0.7  # exits spread over steps 2..8 in this model (checked below)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Reference(checkpoint)


def expected(reference, threshold=THRESHOLD, **rule):
    runs = [
        reference.greedy(p, n, threshold, **rule) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    return [tokens for tokens, _ in runs], [depths for _, depths in runs]


def served(llm, threshold=THRESHOLD, **loops):
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, exit_threshold=threshold, **loops)
        for n in MAX_TOKENS
    ]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.core.leak_report() == []
    return [o.token_ids for o in outputs], [o.exit_depths for o in outputs]


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_latent_diff_exits_equal_the_reference_batched(checkpoint, reference, mode):
    want = expected(reference, max_loops=CAP)
    assert len({d for depths in want[1] for d in depths[1:]}) >= 4  # a real mix of depths
    with LLM(checkpoint, scheduling_mode=mode, **ENGINE) as llm:
        assert llm.engine.model_info().exit_signal == "latent_change"
        assert served(llm, max_loops=CAP) == want
        # min_loops: no exit before it
        assert served(llm, max_loops=CAP, min_loops=5) == expected(
            reference, max_loops=CAP, min_loops=5
        )
        # a request without a threshold runs its fixed depth under the rule
        fixed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert fixed.exit_depths == [4, 4, 4]


def test_the_delayed_rule_exits_one_step_after_its_trigger(checkpoint, reference):
    with LLM(checkpoint, exit_policy="latent_diff_delayed", **ENGINE) as llm:
        got = served(llm, max_loops=CAP)
    want = expected(reference, max_loops=CAP, delayed=True)
    assert got == want
    assert want != expected(reference, max_loops=CAP)


def test_gate_policies_are_refused_for_a_latent_family(checkpoint):
    from rlt_contracts import ConfigurationError

    with pytest.raises(ConfigurationError, match="latent_change"):
        LLM(checkpoint, exit_policy="hazard", **ENGINE)


def test_preemption_keeps_tokens_and_depths(checkpoint, reference):
    tight = dict(ENGINE, num_kv_blocks=64, incremental_kv=True, enable_preemption=True)
    with LLM(checkpoint, **tight) as llm:
        got = served(llm, max_loops=CAP)
        assert llm.get_stats().preemptions > 0
    assert got == expected(reference, max_loops=CAP)


KL_THRESHOLD = 0.15  # KL exits spread over steps 2..7 in this model (both rules)


@pytest.mark.parametrize("policy", ["kl", "kl_delayed"])
def test_kl_exits_equal_the_reference_batched(checkpoint, reference, policy):
    """The KL rules: the coda and head after every step (p_0 uniform), each row's previous
    distribution kept on the device; tokens and exit depths equal the reference's."""
    want = expected(
        reference, KL_THRESHOLD, max_loops=CAP, measure="kl", delayed=policy == "kl_delayed"
    )
    assert len({d for depths in want[1] for d in depths[1:]}) >= 3
    with LLM(checkpoint, exit_policy=policy, **ENGINE) as llm:
        assert served(llm, KL_THRESHOLD, max_loops=CAP) == want
        asked = SamplingParams(max_tokens=2, prompt_logprobs=1, score_at_exit_depth=True)
        with pytest.raises(InvalidRequestError, match="score_at_exit_depth"):
            llm.generate([PROMPTS[0]], asked)


def test_kl_with_speculation_or_exit_depth_scoring_is_refused(tiny_checkpoint):
    checkpoint = tiny_checkpoint()
    """Any family may use the KL rules (they read the head); speculative rounds and
    exit-depth scoring do not compute the distribution, so they are refused with the rule."""
    from rlt_contracts import ConfigurationError

    engine = dict(dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ConfigurationError, match="distribution"):
        LLM(checkpoint, exit_policy="kl", num_speculative_tokens=2, **engine)
    with LLM(checkpoint, exit_policy="kl", **engine) as llm:
        asked = SamplingParams(max_tokens=2, prompt_logprobs=1, score_at_exit_depth=True)
        with pytest.raises(InvalidRequestError, match="distribution"):
            llm.generate([[5, 6, 7]], asked)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, exit_threshold=0.01))[0]
        assert len(out.token_ids) == 4 and llm.engine.core.leak_report() == []
