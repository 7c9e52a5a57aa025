"""The ring KV layout (`kv_layout="ring:K"`, issue 39 item 5) on a tiny Ouro of 4 loops, fp32 on
the CPU: ring:2 and ring:3 equal the dense oracle's ring (tokens and depths) with exits below
the ring's size (the fill of the planes a token never wrote; ring:2 without them:
test_engine_matches_oracle.py); ring:2 batched equals serial under the gate's exits, refill
equals no_refill; ring:4 (as many planes as loops) is last_exited exactly, chunked prefill and
prefix hits included; what a ring cannot keep is refused at start-up (speculation, prefix
caching below the depth) or per request (exit-depth scoring); the flag takes what
`parse_kv_layout` takes.
Huginn-0125's ring against a dense reference: test_huginn_ring_kv.py. Every engine here is
checked for leaked KV blocks by `llm_factory`."""

from __future__ import annotations

import pytest
from rlt import SamplingParams
from rlt_contracts import ConfigurationError, InvalidRequestError
from test_engine_matches_oracle import MAX_TOKENS as ORACLE_MAX_TOKENS
from test_engine_matches_oracle import PROMPTS as ORACLE_PROMPTS
from test_engine_matches_oracle import oracle_outputs

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16, 3]]


def params(threshold=0.55):
    return [
        SamplingParams(max_tokens=8, exit_threshold=threshold, ignore_eos=True, min_loops=1),
        SamplingParams(max_tokens=6, exit_threshold=1.0, ignore_eos=True),
        SamplingParams(max_tokens=7, exit_threshold=threshold, temperature=0.8, seed=5),
    ]


def run(llm, prompts=PROMPTS, sampling=None):
    outputs = llm.generate(prompts, sampling or params())
    return [(o.token_ids, o.exit_depths) for o in outputs]


def test_ring_batched_equals_serial_and_changes_the_model(llm_factory):
    llm = llm_factory(kv_layout="ring:2")
    batched = run(llm)
    serial = [run(llm, [p], [s])[0] for p, s in zip(PROMPTS, params(), strict=True)]
    assert batched == serial
    assert any(d < 4 for _, depths in batched for d in depths[1:])  # early exits: planes filled
    assert run(llm_factory(kv_layout="ring:2", scheduling_mode="no_refill")) == batched
    assert run(llm_factory(kv_layout="last_exited")) != batched  # steps 1, 3 share plane 0


@pytest.mark.parametrize("ring", [2, 3])
def test_early_exits_below_the_ring_equal_the_oracle(llm_factory, tiny_checkpoint, ring):
    """min_loops 1: tokens exit at loops 1..K-1, below the ring's size, so their unwritten planes
    get the exit loop's KV, which later deeper tokens read; tokens and depths equal the dense
    oracle's (packages/rlt-models/tests/oracle, ring semantics written there)."""
    llm = llm_factory(kv_layout=f"ring:{ring}")
    sampling = [
        SamplingParams(max_tokens=n, exit_threshold=0.6, min_loops=1, ignore_eos=True)
        for n in ORACLE_MAX_TOKENS
    ]
    outputs = llm.generate(ORACLE_PROMPTS, sampling)
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    expected = oracle_outputs(path, f"ring:{ring}", 0.6, min_loops=1)
    assert [(o.token_ids, o.exit_depths) for o in outputs] == [
        (r.token_ids, r.exit_depths) for r in expected
    ]
    assert any(d < ring for o in outputs for d in o.exit_depths[1:])  # fills happened


def test_a_ring_of_the_depth_is_last_exited(llm_factory):
    expected = run(llm_factory(kv_layout="last_exited"))
    assert run(llm_factory(kv_layout="ring:4")) == expected
    assert run(llm_factory(kv_layout="ring:6")) == expected  # planes past the depth: none
    cached = llm_factory(kv_layout="ring:4", enable_prefix_caching=True)
    assert run(cached) == expected
    assert run(cached) == expected  # prefix hits
    assert cached.get_stats().prefix_cache_hit_tokens > 0


def test_what_a_ring_cannot_keep_is_refused(llm_factory):
    with pytest.raises(ConfigurationError, match="speculative") as error:
        llm_factory(kv_layout="ring:4", num_speculative_tokens=2, speculative_draft_loops=1)
    assert error.value.options == ("kv_layout", "num_speculative_tokens")
    with pytest.raises(ConfigurationError, match="prefix hits would differ") as error:
        llm_factory(kv_layout="ring:2", enable_prefix_caching=True)
    assert error.value.options == ("kv_layout", "enable_prefix_caching")
    llm = llm_factory(kv_layout="ring:2")
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, score_at_exit_depth=True)
    with pytest.raises(InvalidRequestError, match="kv_layout ring:2"):
        llm.generate([PROMPTS[0]], scored)
    assert run(llm, PROMPTS[:1], params()[:1])  # the engine goes on


def test_the_flag_takes_what_the_one_parser_takes(capsys):
    from rlt.cli import build_parser, engine_config_from_args

    parser = build_parser()
    for flag, expected in (("ring:8", "ring:8"), ("ring:08", "ring:8"), ("shared", "shared")):
        args = parser.parse_args(["generate", "hello", "--kv-layout", flag])
        config = engine_config_from_args(args)
        assert config.runner.kv_layout == expected and config.runner.layout.value == expected
    for bad in ("ring:0", "ring", "diagonal"):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "hello", "--kv-layout", bad])
        assert "ring:K" in capsys.readouterr().err
