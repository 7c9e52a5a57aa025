"""The commands refuse what they cannot serve before anything loads, each with one message
and the documented exit code (docs/configuration.md, Exit codes: 2 for what is refused
before starting):

- `--port` outside 0..65535 is a bad command line (`rlt serve`, `rlt pd serve`);
- a taken port is found before the engine core starts (`rlt serve` with one and with two
  front ends) or before any instance starts (`rlt pd serve`), the message naming host:port;
- a model directory that lacks files is named with everything it lacks (config.json, the
  weights, the tokenizer) by `rlt serve`, `rlt generate` and `rlt pd serve`;
- an error the engine core raises about the model reaches `rlt serve`'s message with the
  field it names (it crosses the process boundary as rlt-contracts' class, with its fields).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from rlt.cli import main
from rlt.engine.assembly import DEFAULT_MODEL_DIR
from rlt_serve.exit_codes import EXIT_USAGE
from serving_harness import free_port

LACKS_EVERYTHING = (
    "it lacks config.json; the weights (model.safetensors, or model.safetensors.index.json "
    "and its shards); the tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt)"
)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test if an engine core or a PD instance is started."""
    from rlt.serving.core_process_client import CoreProcess
    from rlt_pd_coordinator.supervisor import Supervisor

    def started(*args, **kwargs):
        raise AssertionError("started although the command line was refused")

    for owner, name in ((CoreProcess, "spawn"), (CoreProcess, "start"), (Supervisor, "start")):
        monkeypatch.setattr(owner, name, started)


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def refused(argv: list[str], capsys) -> str:
    """Run `rlt ARGV` in this process; it must exit 2 (returned or argparse's SystemExit);
    returns its error output."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == EXIT_USAGE, capsys.readouterr()
    return capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["pd", "serve", "--replicas", "1"]])
@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_outside_0_to_65535_is_a_bad_command_line(command, port, capsys, nothing_starts):
    error = refused([*command, "--port", port], capsys)
    assert f"argument --port: must be in 0..65535, got {port}" in error


@pytest.mark.parametrize(
    "command",
    [["serve"], ["serve", "--api-server-count", "2"], ["pd", "serve", "--replicas", "1"]],
    ids=["serve", "serve --api-server-count 2", "pd serve"],
)
def test_a_taken_port_is_found_before_anything_starts(command, taken_port, capsys, nothing_starts):
    error = refused([*command, "--port", str(taken_port), "--device", "cpu"], capsys)
    assert f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in error


@pytest.mark.parametrize(
    "command",
    [["serve", "{dir}"], ["generate", "--model", "{dir}", "It is"], ["pd", "serve", "{dir}"]],
    ids=["serve", "generate", "pd serve"],
)
def test_an_empty_model_directory_is_named_with_all_it_lacks(
    command, tmp_path, capsys, nothing_starts
):
    argv = [part.format(dir=tmp_path) for part in command]
    if argv[0] == "pd":
        argv += ["--replicas", "1", "--port", str(free_port())]
    error = refused(argv, capsys)
    assert f"model: {tmp_path} is not a complete checkpoint directory; {LACKS_EVERYTHING}" in error
    assert "sentencepiece" not in error


def test_a_directory_without_a_tokenizer_is_named_so(tmp_path, capsys, nothing_starts):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    error = refused(["serve", str(tmp_path), "--port", str(free_port())], capsys)
    assert error.strip().endswith(
        "it lacks the tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt)"
    )
    assert "config.json" not in error.split("it lacks")[1]


def test_the_engine_cores_model_error_reaches_rlt_serve_with_its_field(tmp_path):
    """config.json names an architecture rlt does not serve: the engine core (its own
    process) refuses it, and `rlt serve` says so naming the field, as `rlt generate` does."""
    model = tmp_path / "gpt2"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHead"]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [sys.executable, "-m", "rlt.cli", "serve", str(model), "--device", "cpu"]
    done = subprocess.run(
        [*argv, "--port", str(free_port())], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rlt: error: architectures: ['GPT2LMHead'] is not a looped family")
    assert "Traceback" not in done.stderr
