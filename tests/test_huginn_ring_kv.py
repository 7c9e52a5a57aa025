"""Huginn-0125 with the ring KV layout (`kv_layout="ring:K"`, issue 39 item 5): rlt's greedy
tokens and exit depths equal a dense float64 reference written here, which keeps its KV in K
explicit step planes per core layer (no code shared with rlt-models or rlt-runner), with the
zero initial state; batched equals serial; a ring as large as the depth equals last_exited; no
KV leak after any run; the pool holds more full-length requests than last_exited's. With an fp8
KV cache (`kv_cache_dtype="fp8"`), in last_exited and ring:2, the tokens equal the same reference
storing every K/V rounded to e4m3 with the cache's per-slot scales. Preemption and a
prefill/decode pair (loopback port) keep the ring's tokens.

Ring semantics the reference encodes (`rlt_contracts.KVLayoutSpec`, docs/models.md):
- recurrent step i (1-based) of a position writes its core layers' K/V into plane
  (i - 1) mod K and attends, for every earlier position, to whatever that plane holds; the
  prelude and coda layers keep one K/V per position (the coda's from the position's final
  state);
- a prompt is one block (the authors' `forward` on the prompt): each step runs every prompt
  position at once, so prompt positions read each other's K/V of that very step, and after the
  last step each plane keeps the latest step that used it;
- each generated token then runs alone, step by step, until its exit;
- a position that stops at step e < K has never written planes e..K-1: they get its step-e K/V
  (without this a later, deeper query would read a freed block's stale K/V). No copy at e >= K.

The reference asserts that no query reads a plane entry its position never wrote.

Conditioning as in test_huginn_exits.py: each greedy step's top-2 logit gap exceeds MARGIN
(1e-4) and each exit decision's latent change differs from the threshold by DECISION_MARGIN
(1e-4), so equal tokens and depths are expected, not luck.
"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
from rlt import LLM, SamplingParams
from rlt_contracts import ConfigurationError
from rlt_models import write_random_checkpoint
from safetensors.torch import load_file
from test_family_huginn import CONFIG, ENGINE, INIT, MARGIN, _rms, _rope_pairs
from test_huginn_exits import DECISION_MARGIN, Reference

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]
MAX_TOKENS = [7, 6, 6]
DEFAULT, CAP = 4, 8
THRESHOLD = 0.7  # latent_diff exits spread over steps 2..8 in this model (test_huginn_exits)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("huginn"), CONFIG, seed=3, init=INIT)


class RingReference:
    """Dense float64 Huginn of one request, its KV kept in `ring` step planes (module doc)."""

    def __init__(self, path, ring: int, kv_scales=None) -> None:
        """`kv_scales`: (key scales, value scales) per layer slot of an fp8 cache, whose K/V
        this reference then stores rounded as the cache does (x / s saturated to +-448, to
        e4m3 by round to nearest, times s); None: exact float64 K/V."""
        self.w = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
        self.raw = json.loads((path / "config.json").read_text())
        self.ring = ring
        self.kv_scales = kv_scales
        raw = self.raw
        # store[name][position] = (k, v) [heads, hd]: name is ("core", plane, layer), or
        # ("prelude", layer) / ("coda", layer)
        self.store: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer in range(raw["n_layers_in_prelude"]):
            self.store[("prelude", layer)] = {}
        for layer in range(raw["n_layers_in_coda"]):
            self.store[("coda", layer)] = {}
        for plane in range(ring):
            for layer in range(raw["n_layers_in_recurrent_block"]):
                self.store[("core", plane, layer)] = {}

    def block(self, prefix, x, positions: list[int], kv: dict, slot: int) -> torch.Tensor:
        """A sandwich block over the new `positions` (consecutive): their K/V go into `kv`
        first (`slot`: the layer's slot of its plane, whose fp8 scales apply), then each
        query attends to `kv`'s entries at positions <= its own."""
        w, raw = self.w, self.raw
        n, d, heads = x.shape[0], raw["n_embd"], raw["n_heads"]
        hd, f, eps = d // heads, raw["intermediate_size"], raw["norm_eps"]
        where = torch.tensor(positions)
        h = _rms(x, w[f"{prefix}.norm_1.weight"], eps)
        q, k, v = (
            t.reshape(n, heads, hd) for t in (h @ w[f"{prefix}.attn.Wqkv.weight"].T).split(d, -1)
        )
        bias = w[f"{prefix}.attn.qk_bias"]
        q = _rope_pairs(q + bias[0, 0], where, raw["rope_base"])
        k = _rope_pairs(k + bias[1, 0], where, raw["rope_base"])
        if self.kv_scales is not None:
            key_scales, value_scales = self.kv_scales
            k, v = fp8_rounded(k, key_scales[slot]), fp8_rounded(v, value_scales[slot])
        for j, p in enumerate(positions):
            kv[p] = (k[j], v[j])
        last = positions[-1]
        missing = [p for p in range(last + 1) if p not in kv]
        assert not missing, f"{prefix} would read positions {missing} never written"
        keys = torch.stack([kv[p][0] for p in range(last + 1)])
        values = torch.stack([kv[p][1] for p in range(last + 1)])
        scores = torch.einsum("qhd,khd->hqk", q, keys) * hd**-0.5
        visible = torch.arange(last + 1)[None, :] <= where[:, None]
        attn = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values
        )
        x = _rms(
            x + attn.reshape(n, d) @ w[f"{prefix}.attn.proj.weight"].T,
            w[f"{prefix}.norm_2.weight"],
            eps,
        )
        gate, up = (
            _rms(x, w[f"{prefix}.norm_3.weight"], eps) @ w[f"{prefix}.mlp.fc.weight"].T
        ).split(f, -1)
        return _rms(
            x + (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.proj.weight"].T,
            w[f"{prefix}.norm_4.weight"],
            eps,
        )

    def position_run(self, ids: list[int], start: int, threshold, max_loops, min_loops=1):
        """Positions start..start+len(ids)-1 as one block through prelude, steps, coda; returns
        (logits of the last position, its exit step). Exits (a threshold) only for one token."""
        w, raw = self.w, self.raw
        positions = list(range(start, start + len(ids)))
        e = w["transformer.wte.weight"][torch.tensor(ids)] * raw["init_values"]["embed_scale"]
        for layer in range(raw["n_layers_in_prelude"]):
            e = self.block(
                f"transformer.prelude.{layer}", e, positions, self.store[("prelude", layer)], layer
            )
        s = torch.zeros_like(e)
        exit_step = max_loops
        for step in range(1, max_loops + 1):
            x = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T
            plane = (step - 1) % self.ring
            for layer in range(raw["n_layers_in_recurrent_block"]):
                kv = self.store[("core", plane, layer)]
                x = self.block(f"transformer.core_block.{layer}", x, positions, kv, layer)
            change = float((x[-1] - s[-1]).norm() / x[-1].norm())
            s = x
            if threshold is not None and step >= min_loops and step < max_loops:
                assert abs(change - threshold) > DECISION_MARGIN, "ill-conditioned decision"
                if change < threshold:
                    exit_step = step
                    break
        for plane in range(exit_step, self.ring):  # planes the positions never wrote
            for layer in range(raw["n_layers_in_recurrent_block"]):
                kv, source = (
                    self.store[("core", plane, layer)],
                    self.store[("core", exit_step - 1, layer)],
                )
                for p in positions:
                    kv[p] = source[p]
        x = _rms(s, w["transformer.ln_f.weight"], raw["norm_eps"])
        for layer in range(raw["n_layers_in_coda"]):
            coda = self.store[("coda", layer)]
            slot = raw["n_layers_in_prelude"] + layer  # the coda's slots follow the prelude's
            x = self.block(f"transformer.coda.{layer}", x, positions, coda, slot)
        x = _rms(x, w["transformer.ln_f.weight"], raw["norm_eps"])
        logits = x[-1] @ w.get("lm_head.weight", w["transformer.wte.weight"]).T
        return logits, exit_step


def fp8_rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache stores and reads it back: x / scale in fp32 (as the engine computes
    K/V), saturated to e4m3's +-448, rounded to nearest, times scale."""
    stored = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return stored.double() * scale


@contextlib.contextmanager
def one_thread():
    """The reference's many tiny float64 ops run several times faster on one thread than on
    threads that share busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@one_thread()
def ring_greedy(path, ring, prompt, max_tokens, *, max_loops, threshold=None, kv_scales=None):
    """(tokens, exit depths) of one request: the prompt as one block at max_loops steps, then
    each token alone under its exit rule (token 0: max_loops, no exit)."""
    model = RingReference(path, ring, kv_scales)
    logits, depth = model.position_run(list(prompt), 0, None, max_loops)
    out, depths = [], []
    for _ in range(max_tokens):
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, "ill-conditioned case"
        out.append(int(logits.argmax()))
        depths.append(depth)
        position = len(prompt) + len(out) - 1
        logits, depth = model.position_run([out[-1]], position, threshold, max_loops)
    return out, depths


def served(llm, max_loops=None, threshold=None, prompts=PROMPTS):
    """(tokens, exit depths) per prompt, batched; `threshold` None: the fixed depth."""
    rule = {} if threshold is None else {"exit_threshold": threshold}
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, max_loops=m, **rule)
        for n, m in zip(MAX_TOKENS, max_loops or [None] * len(prompts), strict=True)
    ]
    outputs = llm.generate(prompts, params)
    assert llm.engine.core.leak_report() == []
    return [(o.token_ids, o.exit_depths) for o in outputs]


def engine(layout, **options):
    return {**ENGINE, "kv_layout": layout, **options}


@pytest.mark.parametrize("ring", [2, 3])
def test_ring_equals_the_dense_ring_reference_batched_and_serial(checkpoint, ring):
    """Depths 4 (the default), 7 and 8 (the cap) in one batch: K < every depth, so each
    plane is shared by two or more steps; chunked prefill is asked for (chunks of 5 < the
    prompts of 7 and 11) and ring prompts run whole anyway."""
    loops = [DEFAULT, 7, CAP]
    want = [
        ring_greedy(checkpoint, ring, p, n, max_loops=m)
        for p, n, m in zip(PROMPTS, MAX_TOKENS, loops, strict=True)
    ]
    with LLM(checkpoint, **engine(f"ring:{ring}")) as llm:
        assert served(llm, loops) == want
        for i, prompt in enumerate(PROMPTS):  # serial: each request alone
            alone = llm.generate(
                [prompt],
                SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True, max_loops=loops[i]),
            )[0]
            assert (alone.token_ids, alone.exit_depths) == want[i]
        assert llm.engine.core.leak_report() == []
    with one_thread():
        per_step = [
            Reference(checkpoint).greedy(p, n, None, max_loops=m)
            for p, n, m in zip(PROMPTS, MAX_TOKENS, loops, strict=True)
        ]
    assert [t for t, _ in want] != [t for t, _ in per_step]  # the ring changed the tokens


def test_ring_with_latent_diff_exits_equals_the_reference(checkpoint):
    """ring:4 under a cap of 8 with convergence exits: tokens that exit at e < 4 have planes
    e..3 filled, later deeper tokens read them (checked to happen), and planes shared by
    steps i and i + 4 hold the latest that ran."""
    want = [
        ring_greedy(checkpoint, 4, p, n, max_loops=CAP, threshold=THRESHOLD)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    depths = [d for _, ds in want for d in ds[1:]]
    assert min(depths) < 4 < max(depths)  # fills, then deeper reads of them
    for mode in ("refill", "no_refill"):
        with LLM(
            checkpoint, exit_policy="latent_diff", scheduling_mode=mode, **engine("ring:4")
        ) as llm:
            assert served(llm, [CAP] * 3, THRESHOLD) == want


def test_a_ring_as_deep_as_the_loops_equals_last_exited(checkpoint):
    """ring:4 at depth 4 keeps one plane per step: last_exited's tokens; ring:8 (the cap) is
    last_exited exactly, exits, chunked prefill and prefix hits included."""
    with LLM(checkpoint, **engine("last_exited")) as llm:
        fixed = served(llm)
        adaptive = served(llm, [CAP] * 3, THRESHOLD)
    with LLM(checkpoint, **engine("ring:4")) as llm:
        assert served(llm) == fixed
    assert fixed == [
        ring_greedy(checkpoint, 4, p, n, max_loops=DEFAULT)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    with LLM(checkpoint, **engine("ring:8", enable_prefix_caching=True)) as llm:
        assert served(llm, [CAP] * 3, THRESHOLD) == adaptive
        assert served(llm, [CAP] * 3, THRESHOLD) == adaptive  # prefix hits
        assert llm.get_stats().prefix_cache_hit_tokens > 0
    assert adaptive == [
        ring_greedy(checkpoint, CAP, p, n, max_loops=CAP, threshold=THRESHOLD)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def test_ring_preemption_restores_exactly(checkpoint):
    want = [
        ring_greedy(checkpoint, 2, p, n, max_loops=DEFAULT)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    tight = engine("ring:2", num_kv_blocks=21, incremental_kv=True, enable_preemption=True)
    with LLM(checkpoint, **tight) as llm:
        assert served(llm) == want
        assert llm.get_stats().preemptions > 0


def test_what_a_ring_cannot_keep_is_refused(checkpoint):
    with pytest.raises(ConfigurationError, match="prefix hits would differ"):
        LLM(checkpoint, **engine("ring:4", enable_prefix_caching=True))
    for bad in ("ring:0", "ring:two", "rings:2"):
        with pytest.raises(ConfigurationError, match="ring:K"):
            LLM(checkpoint, **engine(bad))


def test_the_start_up_log_counts_full_length_requests_per_layout(checkpoint, caplog):
    """The same pool (512 blocks of 4 positions) at max_model_len 32 (8 pages): last_exited
    keeps 8 step planes + the stage plane, so 512 // (8 x 9) = 7 full-length requests fit at
    the cap; ring:2 keeps 2 + 1, 512 // (8 x 3) = 21."""
    counts = {}
    for layout, planes in (("last_exited", 8), ("ring:2", 2)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlt.engine.assembly"):
            with LLM(checkpoint, **engine(layout, max_model_len=32)) as llm:
                capacity = llm.engine.parts.kv_capacity
        assert (capacity.loop_planes, capacity.stage_planes) == (planes, 1)
        assert capacity.full_length_requests == 512 // (8 * (planes + 1))
        # K + V of 4 layer slots x 64 wide, fp32, on every plane
        assert capacity.bytes_per_token == (planes + 1) * 4 * 2 * 64 * 4
        line = next(r.getMessage() for r in caplog.records if "KV pool" in r.getMessage())
        assert f"{capacity.full_length_requests} requests of max_model_len 32 fit" in line
        assert f"kv_layout {layout}, {planes} loop plane(s) at a cap of {CAP} loops" in line
        counts[layout] = capacity.full_length_requests
    assert counts == {"last_exited": 7, "ring:2": 21}


@pytest.mark.parametrize("layout", ["last_exited", "ring:2"])
def test_fp8_kv_equals_the_reference_with_the_caches_rounding(checkpoint, layout):
    """fp8 KV is a property of the storage, not of Huginn's math: with the cache's per-slot
    scales (calibrated at load, powers of two; the prelude / coda slots share the core slot's),
    rlt's tokens equal the float64 reference whose every stored K/V is rounded to e4m3 the same
    way, in both layouts; batched equals serial; and the rounding reached the outputs (they
    differ from the fp32 cache's)."""
    ring = CAP if layout == "last_exited" else 2
    with LLM(checkpoint, **engine(layout, kv_cache_dtype="fp8")) as llm:
        key_scale = llm.engine.core.runner.kv.tensors.key_scale.tolist()
        value_scale = llm.engine.core.runner.kv.tensors.value_scale.tolist()
        got = served(llm)
        serial = [
            llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        assert [(o.token_ids, o.exit_depths) for o in serial] == got
    want = [
        ring_greedy(checkpoint, ring, p, n, max_loops=DEFAULT, kv_scales=(key_scale, value_scale))
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    assert got == want
    with LLM(checkpoint, **engine(layout)) as llm:
        assert served(llm) != got


def test_a_prefill_decode_pair_keeps_the_ring(checkpoint):
    """PD over the loopback port with ring:2: the prefill side computes each prompt whole and
    hands over both step planes and the stage plane; the decode side's tokens equal the
    reference's (and one engine's)."""
    from family_feature_checks import pd_outputs

    want = [
        ring_greedy(checkpoint, 2, p, n, max_loops=DEFAULT)
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs, _, engines = pd_outputs(
        lambda **extra: LLM(checkpoint, **engine("ring:2", **extra)), PROMPTS, params, nixl=False
    )
    try:
        assert [(o.token_ids, o.exit_depths) for o in outputs] == want
        assert all(llm.engine.core.leak_report() == [] for llm in engines)
    finally:
        for llm in engines:
            llm.shutdown()
