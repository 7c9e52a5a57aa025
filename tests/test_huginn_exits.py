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

import pytest
import torch
from rlt import LLM, SamplingParams
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

    def run(self, ids, depths, rule):
        """Logits of the last position and its exit step. `depths`: the exit steps of every
        position but the last; the last one's is decided by `rule` (threshold, min_loops,
        max_loops, delayed), or is `rule`'s max_loops when the threshold is None."""
        threshold, min_loops, max_loops, delayed = rule
        w, raw = self.w, self.raw
        eps = raw["norm_eps"]
        e = w["transformer.wte.weight"][torch.tensor(ids)] * raw["init_values"]["embed_scale"]
        for i in range(raw["n_layers_in_prelude"]):
            e, _ = self.block(f"transformer.prelude.{i}", e)
        s = torch.zeros_like(e)
        stored = [None] * raw["n_layers_in_recurrent_block"]
        last_exit, pending, changes = None, None, []
        for step in range(1, max_loops + 1):
            known = torch.tensor([step <= d for d in depths] + [last_exit is None])
            x = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T
            for i in range(raw["n_layers_in_recurrent_block"]):
                x, kv = self.block(f"transformer.core_block.{i}", x, stored[i], ~known)
                stored[i] = kv  # exited positions keep their exit step's (replaced above)
            if last_exit is None:
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
        x = _rms(s, w["transformer.ln_f.weight"], eps)
        for i in range(raw["n_layers_in_coda"]):
            x, _ = self.block(f"transformer.coda.{i}", x)
        x = _rms(x, w["transformer.ln_f.weight"], eps)
        return (x @ w.get("lm_head.weight", w["transformer.wte.weight"]).T)[-1], last_exit

    def greedy(self, prompt, max_tokens, threshold, *, min_loops=1, max_loops=CAP, delayed=False):
        """(tokens, exit depths) of one request: the prompt at max_loops, then each token at
        its rule's exit step."""
        ids, depths, out, out_depths = list(prompt), [max_loops] * (len(prompt) - 1), [], []
        rule = (None, min_loops, max_loops, delayed)
        for _ in range(max_tokens):
            logits, depth = self.run(ids, depths, rule)
            top = logits.topk(2).values
            assert top[0] - top[1] > MARGIN, "ill-conditioned case"
            out.append(int(logits.argmax()))
            out_depths.append(depth)
            depths.append(depth)
            ids.append(out[-1])
            rule = (threshold, min_loops, max_loops, delayed)  # token 0 ran without exits
        return out, out_depths


THRESHOLD = 0.7  # exits spread over steps 2..8 in this model (checked below)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Reference(checkpoint)


def expected(reference, **rule):
    runs = [
        reference.greedy(p, n, THRESHOLD, **rule) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    return [tokens for tokens, _ in runs], [depths for _, depths in runs]


def served(llm, **loops):
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, exit_threshold=THRESHOLD, **loops)
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
