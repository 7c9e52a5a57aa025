"""One configuration tree, declared once (issue 40 items 1-2): every command that runs an engine
takes every engine option from the option structs (rlt_serve.option_flags) with the same help,
every server its front's options (FrontOptions, the loop defaults nested), the flags read back
into the same `EngineConfig`, and docs/configuration.md lists exactly those options with their
defaults."""

from __future__ import annotations

import enum
import re
from pathlib import Path

import pytest
from rlt.cli import build_parser as rlt_parser
from rlt.cli import engine_config_from_args
from rlt.engine import EngineConfig
from rlt_contracts import ConfigurationError, EngineOptions, option_fields
from rlt_pd_coordinator.cli import build_parser as pd_parser
from rlt_serve import LoopDefaults
from rlt_serve.cli_help import commands, rendered_help
from rlt_serve.front_options import FrontOptions

REPO = Path(__file__).resolve().parents[1]
FIELDS = {f.flags[0]: f for f in option_fields(EngineOptions)}
VLLM_ALIASES = ("--enforce-eager", "--trust-remote-code", "--tensor-parallel-size")
COMMANDS = ("rlt generate", "rlt serve", "rlt pd serve", "rlt ray serve", "rlt ray pd serve")
# what a command leaves out of the generated flags, and why: an instance's PD role is set by
# `rlt serve --pd-role` alone (the coordinators assign roles, the others run whole engines);
# the PD coordinator's own --device lists its local instances' devices
NOT_GENERATED = {"--pd-role": set(COMMANDS) - {"rlt serve"}, "--device": {"rlt pd serve"}}


def command_parsers() -> dict:
    ray_cli = pytest.importorskip("rlt_ray.cli")
    found = {}
    for parser in (rlt_parser(), pd_parser(), ray_cli.build_parser()):
        for words, command in commands(parser):
            found[" ".join((parser.prog, *words))] = command
    return {name: found[name] for name in COMMANDS}


def helps(parser, flags, command: str = "") -> dict[str, str]:
    """flag -> help as `--help` shows it, of `flags` (those `command` generates)."""
    return {
        action.option_strings[0]: rendered_help(parser, action)
        for action in parser._actions
        if action.option_strings
        and action.option_strings[0] in flags
        and command not in NOT_GENERATED.get(action.option_strings[0], ())
    }


def engine_helps(parser, command: str) -> dict[str, str]:
    return helps(parser, {*FIELDS, *VLLM_ALIASES}, command)


def test_every_command_lists_every_engine_option_with_the_same_help():
    parsers = command_parsers()
    helps = {name: engine_helps(parser, name) for name, parser in parsers.items()}
    everything = helps["rlt serve"]
    assert set(everything) == {*FIELDS, *VLLM_ALIASES}
    for name in COMMANDS:
        expected = {f: h for f, h in everything.items() if name not in NOT_GENERATED.get(f, ())}
        assert helps[name] == expected, name
    # the help is the field's own (defaults appended by the formatter)
    for flag, field in FIELDS.items():
        assert everything[flag].startswith(field.option.help.split("%(")[0]), flag


def test_every_server_lists_the_front_options_and_every_command_the_loop_flags():
    parsers = command_parsers()
    front = {f.flags[0] for f in option_fields(FrontOptions)}
    loops = {f.flags[0] for f in option_fields(LoopDefaults)}
    assert loops < front
    servers = {name: helps(parser, front) for name, parser in parsers.items() if "serve" in name}
    assert len(servers) == 4 and set(servers["rlt serve"]) == front
    assert all(found == servers["rlt serve"] for found in servers.values())
    assert helps(parsers["rlt generate"], loops) == helps(parsers["rlt serve"], loops)


def test_flags_read_back_as_the_options_they_name():
    argv = [
        "generate",
        "hi",
        "--device=cpu",
        "--kv-watermark=0.25",
        "--scheduling-mode=no_refill",
        "--num-speculative-tokens=2",
        "--speculative-disable-batch-size=none",
        "--pd-kv-timeout-s=60",
        "--no-async-scheduling",
        "--disable-log-stats",
        "--hf-overrides",
        '{"num_loops": 3}',
        "--prefill-step-decode-ticks=auto",
    ]
    config = engine_config_from_args(rlt_parser().parse_args(argv))
    assert config == EngineConfig.from_options(
        device="cpu",
        kv_watermark=0.25,
        scheduling_mode="no_refill",
        num_speculative_tokens=2,
        speculative_disable_batch_size=None,
        pd_kv_timeout_s=60.0,
        async_scheduling=False,
        log_stats=False,
        hf_overrides={"num_loops": 3},
        prefill_step_decode_ticks="auto",
    )
    assert config.scheduler.watermark_ratio == 0.25 and config.pd.kv_timeout_s == 60.0
    assert config.runner.speculation.disable_batch_size is None
    # every option unset: the structs' defaults, as Python gets them
    default = engine_config_from_args(rlt_parser().parse_args(["serve", "--device", "cpu"]))
    assert default == EngineConfig.from_options(device="cpu")
    with pytest.raises(ConfigurationError, match="kv_watermark"):
        EngineConfig.from_options(device="cpu", kv_watermark=1.0)
    assert default.with_options(pd_role="decode").pd.role == "decode"


def documented_options() -> dict[str, str]:
    """option -> its default cell, from docs/configuration.md's `| option |` tables."""
    found, in_table = {}, False
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("| option |"):
            in_table = True
        elif in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            name = re.match(r"`(\w+)`", cells[0])
            if name:
                found[name.group(1)] = cells[1]
        else:
            in_table = False
    return found


def default_shown(value) -> tuple[str, ...]:
    if isinstance(value, bool):
        return ("on", "True") if value else ("off", "False")
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return (f"`{value}`",)
    if isinstance(value, int | float):
        return (f"{value:,}", f"{value:g}", str(value))
    return ()


def test_the_configuration_doc_lists_every_option_with_its_default():
    documented = documented_options()
    assert set(documented) == {f.name for f in option_fields(EngineOptions)}
    for field in option_fields(EngineOptions):
        if field.name == "cpu_kv_cache_bytes":
            assert documented[field.name] == f"{field.default // 2**30} GiB"
            continue
        shown = default_shown(field.default)
        cell = documented[field.name]
        assert not shown or any(cell.startswith(s) for s in shown), (field.name, cell)
