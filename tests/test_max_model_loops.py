"""The engine's loop cap `max_model_loops` (`--max-model-loops`, issue 38 "Depth per request"):
the model depth T the KV planes, runner and scheduler are sized for, while a request that omits
`max_loops` runs the checkpoint's count.

- Nanbeige (2 loops) under a cap of 4: requests without `max_loops` give the tokens of an
  uncapped engine (and of the dense fp64 reference of tests/test_family_nanbeige.py at 2
  loops); `max_loops` 3 and 4 equal that reference at 3 and 4 loops; 5 is refused naming the
  cap; depths mixed in one batch equal serial runs; a prompt run at the default depth never
  shares prefix-cache pages with the same prompt at another depth, and its own pages serve the
  next request at its depth; preemption restores exactly; no KV leaks.
- HRM-Text (one loop = one H cycle with its L cycles) under a cap of 3: `max_loops=3` equals
  transformers' own model at H_cycles 3, the default its H_cycles 2.
- Ouro refuses a cap above its checkpoint's depth at start-up; any family refuses a cap below
  its default depth (naming hf_overrides); the HTTP server reports the cap and the default in
  /v1/models and answers a request above the cap with a 400 naming --max-model-loops.
- `--max-model-loops` parses on every command that runs an engine (`rlt generate`, `rlt
  serve`, `rlt pd serve` through rlt serve's parser; `rlt ray ...` in services/rlt-ray's tests),
  and the PD coordinator accepts instances whose depth is a cap of its checkpoint.

Conditioning as in test_family_nanbeige.py: each reference step's top-2 gap exceeds 1e-4.
"""

from __future__ import annotations

import logging

import pytest
from rlt import LLM, SamplingParams
from rlt.cli import build_parser
from rlt_contracts import ConfigurationError, InvalidRequestError, PDRole
from rlt_models import NanbeigeConfig, OuroConfig, parse_config, write_random_checkpoint
from rlt_models.errors import ModelConfigError
from test_family_nanbeige import CONFIG, ENGINE, MAX_TOKENS, PROMPTS, generate, reference_greedy

CAP = 4  # over the checkpoint's 2 loops


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("nanbeige_cap"), CONFIG, seed=11)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {
        loops: [
            reference_greedy(checkpoint, p, n, loops)
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        for loops in (2, 3, 4)
    }


@pytest.fixture(scope="module")
def capped(checkpoint):
    """One capped engine shared by the cases (prefix caching on: every case also checks that
    cached pages of one depth never serve another)."""
    llm = LLM(checkpoint, max_model_loops=CAP, enable_prefix_caching=True, **ENGINE)
    yield llm
    assert llm.engine.core.leak_report() == []
    llm.shutdown()


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_the_cap_sizes_the_engine_and_the_default_stays_the_checkpoints(capped):
    info = capped.engine.model_info()
    assert (info.num_loops, info.default_loops) == (CAP, 2)
    assert capped.engine.core.kv.num_planes == CAP  # one KV plane per loop of the cap


def test_requests_without_max_loops_run_the_checkpoints_depth(checkpoint, capped, expected):
    outputs = generate(capped)
    assert tokens(outputs) == expected[2]
    assert all(o.exit_depths == [2] * len(o.token_ids) for o in outputs)
    with LLM(checkpoint, **ENGINE) as uncapped:
        assert tokens(generate(uncapped)) == expected[2]


@pytest.mark.parametrize("loops", [3, 4])
def test_deeper_requests_equal_the_dense_reference_at_their_depth(capped, expected, loops):
    outputs = generate(capped, max_loops=loops)
    assert tokens(outputs) == expected[loops]
    assert all(o.exit_depths == [loops] * len(o.token_ids) for o in outputs)


def test_a_request_above_the_cap_is_refused_naming_it(capped):
    with pytest.raises(InvalidRequestError, match="--max-model-loops") as info:
        generate(capped, max_loops=CAP + 1)
    assert info.value.field == "max_loops" and f"({CAP}" in info.value.message


def test_mixed_depths_in_one_batch_equal_serial_runs(capped, expected):
    depths = [None, 3, 4]  # None: the default, 2
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, max_loops=d)
        for n, d in zip(MAX_TOKENS, depths, strict=True)
    ]
    batched = tokens(capped.generate(PROMPTS, params))
    serial = [tokens(capped.generate([p], [s]))[0] for p, s in zip(PROMPTS, params, strict=True)]
    assert batched == serial == [expected[d or 2][i] for i, d in enumerate(depths)]


def test_prefix_pages_of_one_depth_serve_only_that_depth(capped, expected):
    """The default depth (2) is below the model depth (4): its prompt's pages carry the loop
    count in their salt, so the 4-loop request does not take them, nor they its pages."""
    for loops in (None, CAP, 3, None, CAP):
        before = capped.get_stats().prefix_cache_hit_tokens
        assert tokens(generate(capped, max_loops=loops)) == expected[loops or 2]
    assert capped.get_stats().prefix_cache_hit_tokens > before  # the repeat hit its own pages


def test_start_up_logs_the_cap_and_preemption_under_it_is_exact(checkpoint, expected, caplog):
    with (
        caplog.at_level(logging.INFO, logger="rlt.engine.family_setup"),
        LLM(
            checkpoint,
            max_model_loops=CAP,
            **{**ENGINE, "num_kv_blocks": 26, "max_num_seqs": 3},
            incremental_kv=True,
            enable_preemption=True,
        ) as tight,
    ):
        assert "2 loops by default, at most 4 per request (max_model_loops" in caplog.text
        outputs = tight.generate(
            PROMPTS,
            [
                SamplingParams(max_tokens=n, ignore_eos=True, max_loops=d)
                for n, d in zip(MAX_TOKENS, [None, CAP, 3], strict=True)
            ],
        )
        assert tokens(outputs) == [expected[2][0], expected[CAP][1], expected[3][2]]
        assert tight.get_stats().preemptions > 0
        assert tight.engine.core.leak_report() == []


# -- what the family allows --------------------------------------------------------------------


def test_the_parsed_config_carries_the_cap_and_never_writes_it():
    raw = CONFIG.to_dict()
    config = parse_config(raw, max_model_loops=CAP)
    family = config.declaration()
    assert (config.shape().num_loops, family.default_loops, family.max_loops) == (CAP, 2, CAP)
    assert family.loop_limit is None
    assert "max_model_loops" not in config.to_dict()  # an engine setting, not the checkpoint's
    with pytest.raises(ModelConfigError, match="max_model_loops"):  # nor read from config.json
        parse_config({**raw, "max_model_loops": CAP})
    assert parse_config(raw) == NanbeigeConfig.from_dict(raw)  # no cap: the default


def test_ouro_refuses_a_cap_above_its_checkpoint_depth(tmp_path):
    raw = OuroConfig.ouro_1_4b().to_dict()
    assert parse_config(raw, max_model_loops=4).shape().num_loops == 4
    with pytest.raises(ModelConfigError, match="at most 4 loops") as info:
        parse_config(raw, max_model_loops=5)
    assert info.value.options == ("max_model_loops",)
    # at start-up, before the weights load
    tiny = OuroConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        total_ut_steps=4,
        max_position_embeddings=64,
    )
    path = write_random_checkpoint(tmp_path / "ouro", tiny, seed=1)
    with pytest.raises(ConfigurationError, match="at most 4 loops"):
        LLM(path, max_model_loops=8, **ENGINE)


def test_a_cap_below_the_default_depth_or_not_positive_is_refused(checkpoint):
    with pytest.raises(ConfigurationError, match="hf_overrides"):
        LLM(checkpoint, max_model_loops=1, **ENGINE)
    with pytest.raises(ConfigurationError, match="max_model_loops"):
        LLM(checkpoint, max_model_loops=0, **ENGINE)


def test_hrm_text_loops_are_h_cycles_under_the_cap(tmp_path):
    transformers = pytest.importorskip("transformers")
    del transformers
    from test_family_hrm_text import ENGINE as HRM_ENGINE
    from test_family_hrm_text import generate as hrm_generate
    from test_family_hrm_text import reference, write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "hrm")
    with LLM(path, max_model_loops=3, **HRM_ENGINE) as llm:
        info = llm.engine.model_info()
        assert (info.num_loops, info.default_loops) == (3, 2)
        default_tokens, default_depths = hrm_generate(llm)
        deeper = llm.generate(
            PROMPTS,
            [SamplingParams(max_tokens=n, ignore_eos=True, max_loops=3) for n in MAX_TOKENS],
        )
        assert llm.engine.core.leak_report() == []
    assert default_tokens == reference(path, prefix_lm=True)
    assert all(d == [2] * len(d) for d in default_depths)
    # transformers sizes its cache by the saved (inflated) layer count: 2 per stack x 3 x 3
    assert tokens(deeper) == reference(path, prefix_lm=True, H_cycles=3, num_hidden_layers=18)
    assert all(o.exit_depths == [3] * len(o.token_ids) for o in deeper)


# -- served, and on every command line ----------------------------------------------------------


def test_served_with_the_cap_in_v1_models_and_a_400_above_it(checkpoint):
    from serving_harness import run_server

    with (
        run_server(checkpoint, engine={"max_model_loops": CAP}) as server,
        server.http() as http,
    ):
        card = http.get("/v1/models").json()["data"][0]
        assert (card["num_loops"], card["default_loops"]) == (CAP, 2)
        body = {"prompt": [5, 17, 200, 3], "max_tokens": 3, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["exit_depths"] == [2, 2, 2]
        deep = http.post("/v1/completions", json={**body, "max_loops": CAP})
        assert deep.json()["choices"][0]["exit_depths"] == [CAP] * 3
        refused = http.post("/v1/completions", json={**body, "max_loops": CAP + 1})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "max_loops" and "--max-model-loops" in error["message"]
        server.wait_idle()


def test_server_loop_defaults_are_checked_against_the_cap():
    """--max-loops is the default of requests that omit max_loops: at most the cap; unset,
    the engine's default depth applies (the front sends none)."""
    from rlt_contracts import ModelInfo
    from rlt_serve import LoopDefaults

    info = ModelInfo("m", "m", 64, 320, num_loops=3, eos_token_ids=(0,), default_loops=2)
    assert LoopDefaults(max_loops=3).for_model(info).max_loops == 3
    assert LoopDefaults().for_model(info).max_loops is None
    with pytest.raises(ConfigurationError, match="--max-model-loops"):
        LoopDefaults(max_loops=4).for_model(info)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hello", "--max-model-loops", "4"],
        ["serve", "MODEL", "--max-model-loops", "4", "--max-loops", "3"],
    ],
    ids=["generate", "serve"],
)
def test_the_flag_parses_into_the_engine_config(argv):
    from rlt.cli import engine_config_from_args

    args = build_parser().parse_args(argv)
    assert engine_config_from_args(args).model.max_model_loops == 4


def test_rlt_pd_serve_passes_the_flag_to_its_instances():
    from rlt_pd_coordinator.cli import parse as parse_pd

    options = parse_pd(["serve", "--replicas", "1", "--max-model-loops", "4"])
    assert options.engine_args == ("--max-model-loops", "4")
    args = build_parser().parse_args(["serve", *options.engine_args])
    assert args.max_model_loops == 4


def test_the_pd_coordinator_takes_its_instances_depth_when_the_checkpoint_allows_it(checkpoint):
    from rlt_pd_coordinator.cluster import Instance
    from rlt_pd_coordinator.server import build_model_info

    def instances(depth):
        made = [Instance(f"i{k}", PDRole.NONE, f"http://i{k}", 1) for k in range(2)]
        for instance in made:
            instance.num_loops = depth
        return made

    info = build_model_info(checkpoint, None, instances(CAP))
    assert (info.num_loops, info.default_loops) == (CAP, 2)
    assert build_model_info(checkpoint, None, instances(None)).num_loops == 2
    with pytest.raises(ConfigurationError, match="model directory"):
        build_model_info(checkpoint, None, instances(1))  # below the default: another model
