"""Help that explains itself (issue 41; docs/serving.md; docs/configuration.md, "Defaults by
entry point").

- Every option of every command (rlt, rlt pd, rlt ray) shows its default and a meaning; the
  help shows them as the docs quote them.
- `rlt --version` lists the distributions.
- `rlt generate` shows a progress bar (requests, tokens) on a terminal only.
- Each entry point's default temperature, exit threshold and seed is what the table in
  docs/configuration.md says, and each says so where it is configured: SamplingParams' docstring,
  `rlt generate --help`, the HTTP request schema, the playground's form.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import sys
import termios
import threading
from pathlib import Path

import pytest
from rlt.cli import build_parser, main, run_generate, sampling_params_from_args
from rlt_contracts import SamplingParams
from rlt_serve.cli_help import commands, explain_defaults, undocumented_options

ROOT = Path(__file__).resolve().parents[1]


# -- help that explains itself -------------------------------------------------------------------


def every_command():
    """(command words, parser) of rlt, rlt pd and (when installed) rlt ray."""
    from rlt_pd_coordinator.cli import build_parser as pd_parser

    roots = [(("rlt",), build_parser()), (("rlt", "pd"), pd_parser())]
    try:
        from rlt_ray.cli import build_parser as ray_parser
    except ImportError:  # rlt-ray (and Ray) not installed
        pass
    else:
        roots.append((("rlt", "ray"), ray_parser()))
    for prefix, root in roots:
        for path, parser in commands(explain_defaults(root)):
            yield " ".join((*prefix, *path)), parser


def test_every_option_of_every_command_shows_its_default_and_meaning():
    walked = {name: undocumented_options(parser) for name, parser in every_command()}
    assert {"rlt generate", "rlt serve", "rlt bench serve", "rlt pd serve"} <= set(walked)
    assert {name: found for name, found in walked.items() if found} == {}


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in (
        "port to listen on, 0..65535 (0: any free) (default: 8000)",
        "--block-size BLOCK_SIZE token positions per KV block (default: 16)",
        "(default: off)",
        "--seed SEED seed of every request that gives none",
    ):
        assert text in shown


def test_version_lists_the_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines[:-1]]
    assert names[0] == "rlt" and {"rlt-contracts", "rlt-serve", "rlt-scheduler"} <= set(names)
    assert lines[-1].startswith("with python ") and " torch " in lines[-1]


# -- rlt generate's progress bar -----------------------------------------------------------------

GENERATE = ["generate", "--device", "cpu", "--dtype", "float32", "--max-tokens", "6"]


def test_generate_shows_a_progress_bar_on_a_terminal(monkeypatch, capsys):
    leader, follower = pty.openpty()
    # a terminal of 120 columns (a new pseudo-terminal has 0: tqdm would draw an empty bar)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    shown: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other end closed
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with os.fdopen(follower, "w", buffering=1) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert run_generate(build_parser().parse_args([*GENERATE, "It is", "My dear"])) == 0
    reader.join(timeout=10)
    os.close(leader)
    bar = b"".join(shown).decode(errors="replace")
    assert "generating: 100%" in bar and "2/2" in bar, bar
    assert " tokens, " in bar and "tok/s" in bar, bar
    assert "exit depths:" in capsys.readouterr().out


def test_generate_in_a_pipe_shows_no_progress_bar(capsys):
    assert main([*GENERATE, "--trust-remote-code", "It is", "My dear"]) == 0
    captured = capsys.readouterr()
    assert "generating" not in captured.err
    assert "rlt: note: --trust-remote-code changes nothing" in captured.err
    assert captured.out.count("exit depths:") == 2


# -- each entry point's defaults -----------------------------------------------------------------


def documented_defaults() -> dict[str, list[str]]:
    """docs/configuration.md's "Defaults by entry point": entry point -> the first word of its
    temperature, exit threshold and seed cells."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("## Defaults by entry point", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {row[0].strip(): [cell.split()[0].strip(",") for cell in row[1:]] for row in rows[2:]}


def flat(text: str | None) -> str:
    return " ".join((text or "").split())


def test_each_entry_point_states_its_temperature_exit_threshold_and_seed():
    from rlt_contracts import DEFAULT_GATE_EXIT_THRESHOLD
    from rlt_serve.request_schemas import CompletionRequest

    documented = documented_defaults()
    python = SamplingParams()
    row = documented["`SamplingParams()` in Python (`LLM.generate`)"]
    assert row == ["0", "1.0", "0"]
    assert (python.temperature, python.exit_threshold, python.seed) == (0.0, 1.0, 0)
    doc = flat(SamplingParams.__doc__)
    stated = ("before sampling. Default 0,", "(adaptive exit disabled). Default 1.0", "(default 0)")
    for text in stated:
        assert text in doc, text

    parser = build_parser()
    args = parser.parse_args(["generate", "It is"])
    gated = sampling_params_from_args(args, "gate")
    assert documented["`rlt generate`"] == ["0", "0.5", "0"]
    assert (gated.temperature, gated.exit_threshold, gated.seed) == (0.0, 0.5, 0)
    (generate,) = [p for path, p in commands(parser) if path == ("generate",)]
    shown = {a.dest: flat(a.help) for a in generate._actions}
    assert "(default: 0 here and in SamplingParams;" in shown["temperature"]
    assert "default: 0.5 for a model with an exit gate" in shown["exit_threshold"]

    http = documented["HTTP: `rlt serve`, `rlt pd serve`, `rlt ray serve`"]
    temperature = CompletionRequest.model_fields["temperature"]
    assert http[:2] == ["1.0", "0.5"] and temperature.default == 1.0
    assert "Default 1.0" in temperature.description
    assert DEFAULT_GATE_EXIT_THRESHOLD == 0.5  # the servers' --exit-threshold for a gated model
    exit_threshold = CompletionRequest.model_fields["exit_threshold"]
    assert "(0.5 for a model with an exit gate;" in exit_threshold.description

    page = (ROOT / "packages/rlt-serve/src/rlt_serve/static/playground.html").read_text()
    form = dict(re.findall(r'<input id="([a-z-]+)" type="number"[^>]* value="([0-9.]+)"', page))
    assert documented["the playground page"][:2] == ["0.7", "0.5"]
    assert (form["temperature"], form["exit-threshold"]) == ("0.7", "0.5")
