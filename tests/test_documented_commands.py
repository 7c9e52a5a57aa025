"""Every command README.md and docs/ show works as shown.

- Each `rlt ...` line of their code blocks parses with the real argument parsers, without
  starting anything (`rlt pd serve`'s engine flags with `rlt serve`'s parser, its options
  checked): a renamed or removed flag, or a command that no longer exists, fails here.
- The commands run through the installed console script under `uv run` (the README's
  launcher), each in a process group of its own, as a terminal or a supervisor runs them:
  `rlt generate`; `rlt serve` (one and two front ends) and `rlt pd serve` (prefill/decode and
  plain replicas) each print the URL they serve once they answer, answer a streaming and a
  plain request, and stop on a process-group SIGINT sent while both are in flight: both
  finish (the drain), exit 0, no traceback, no process left. Against the running `rlt serve`,
  the docs' curl commands answer 200, `rlt bench serve` runs as documented, and a prompt
  refused with 400 logs no tokenizer warning.

Ray's commands (`rlt ray ...`) are left to services/rlt-ray's tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from launcher_harness import REPO, UV, InFlight, Launch, check_stopped_cleanly
from rlt.cli import build_parser
from rlt_pd_coordinator.cli import parse as parse_pd
from rlt_serve.shutdown import STOP_BOUND_MARGIN_S
from serving_harness import free_port

DOCUMENTS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
DOCUMENTS.append("services/rlt-engine/README.md")
COMMAND = re.compile(r"^(?:\$ )?(?:uv run )?rlt [a-z]")
PLACEHOLDERS = {"...", "&"}
ALTERNATIVES = re.compile(r"^[\w-]+(\|[\w-]+)+$")  # `prefill|decode`: one of them
# documented (docs/serving.md, Shutdown): from the signal to the exit at the default
# --shutdown-timeout; requests of a few tokens finish first, and then the server stops at once
DRAIN_BOUND_S = 10 + STOP_BOUND_MARGIN_S
STREAM_TOKENS = 8  # the stream in flight at the signal; the plain request asks for twice that


@dataclass(frozen=True)
class Snippet:
    where: str  # path:line
    text: str  # as written, continuation lines joined


def code_lines(path: str) -> list[tuple[int, str, bool]]:
    """(line number, line, whether a command may start there) of a document's code: fenced
    blocks (a command starts unindented: a diagram's indented lines are none) and 4-space
    indented blocks."""
    found, fenced = [], False
    for number, line in enumerate((REPO / path).read_text().splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            found.append((number, line.strip(), not line[:1].isspace()))
        elif line.startswith("    "):
            found.append((number, line.strip(), True))
    return found


def snippets(path: str, start: re.Pattern) -> list[Snippet]:
    """Code lines matching `start`, with their continuation lines (a trailing backslash, or a
    quote still open)."""
    lines, found = code_lines(path), []
    for index, (number, line, may_start) in enumerate(lines):
        if not (may_start and start.match(line)):
            continue
        text, following = line, iter(lines[index + 1 :])
        while text.endswith("\\") or not _balanced(text):
            text = text.removesuffix("\\") + " " + next(following)[1]
        found.append(Snippet(f"{path}:{number}", text))
    return found


def _balanced(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # no closing quotation
        return False
    return True


def command_argv(text: str) -> list[str]:
    """The arguments after `rlt`, placeholders dropped: `[engine flags]`, `...`, `&`; of
    `a|b` alternatives the first."""
    tokens = shlex.split(text.removeprefix("$ "), comments=True)
    tokens = tokens[2:] if tokens[:2] == ["uv", "run"] else tokens
    assert tokens[0] == "rlt", text
    argv, in_brackets = [], False
    for token in tokens[1:]:
        if token.startswith("[") and not _is_json(token):
            in_brackets = True
        if in_brackets:
            in_brackets = not token.endswith("]")
        elif token not in PLACEHOLDERS:
            argv.append(token.split("|")[0] if ALTERNATIVES.match(token) else token)
    return argv


def _is_json(token: str) -> bool:
    try:
        json.loads(token)
    except ValueError:
        return False
    return True


def documented_commands() -> list[Snippet]:
    found = [s for path in DOCUMENTS for s in snippets(path, COMMAND)]
    return [s for s in found if command_argv(s.text)[:1] != ["ray"]]  # services/rlt-ray's


def parse_as_the_command_would(argv: list[str]) -> None:
    """Parse without starting anything; argparse's SystemExit on a bad command line."""
    if argv[:1] == ["pd"]:
        options = parse_pd(argv[1:])
        options.check()
        build_parser().parse_args(["serve", *options.engine_args])
    else:
        build_parser().parse_args(argv)


def find(where: str, start: str) -> Snippet:
    """The documented command at `where` (a path) that starts with `start`."""
    matches = [s for s in documented_commands() if s.where.startswith(where + ":")]
    matches = [s for s in matches if " ".join(command_argv(s.text)).startswith(start)]
    assert len(matches) == 1, (where, start, matches)
    return matches[0]


# -- every documented command line parses --------------------------------------------------------


def test_the_documents_show_the_commands_run_below():
    found = documented_commands()
    assert len(found) >= 12, found
    for where, start in LIVE_COMMANDS.values():
        find(where, start)


@pytest.mark.parametrize("snippet", documented_commands(), ids=lambda s: s.where)
def test_each_documented_command_line_parses(snippet, capsys):
    try:
        parse_as_the_command_would(command_argv(snippet.text))
    except SystemExit:
        pytest.fail(f"{snippet.where}: `{snippet.text}` is refused:\n{capsys.readouterr().err}")


@pytest.mark.parametrize(
    "argv",
    [["serve", "--no-such-flag"], ["generate"], ["pd", "serve", "--replicas", "one"]],
    ids=["unknown flag", "missing prompt", "bad value"],
)
def test_the_parse_check_refuses_a_broken_command(argv):
    with pytest.raises(SystemExit):
        parse_as_the_command_would(argv)


def test_pd_engine_flags_are_checked_with_rlt_serves_parser():
    with pytest.raises(SystemExit):
        parse_as_the_command_would(["pd", "serve", "--replicas", "1", "--dtype", "float64"])


# -- the documented commands, run --------------------------------------------------------------

# (document, the command's start) of each command run below, as the document shows it
LIVE_COMMANDS = {
    "generate": ("README.md", "generate"),
    "serve": ("README.md", "serve"),
    "pd": ("docs/pd.md", "pd serve MODEL --num-prefill 1 --num-decode 1"),
    "replicas": ("docs/pd.md", "pd serve MODEL --replicas 2"),
    "bench": ("docs/serving.md", "bench serve --num-prompts 200"),
}
# the servers: the documented command plus what a test needs (a free port; `--device cpu`
# where the README's plain `rlt serve` already ran, so that cores and front ends are forked,
# not spawned: one interpreter start instead of one per process)
SERVERS = {
    "serve": ("serve", ()),
    "serve --api-server-count 2": ("serve", ("--api-server-count", "2", "--device", "cpu")),
    "pd": ("pd", ("--device", "cpu")),
    "replicas": ("replicas", ("--device", "cpu")),
}
live = pytest.mark.skipif(UV is None, reason="the documented commands run under `uv run`")
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def live_argv(name: str, *extra: str) -> list[str]:
    """The documented command's argv, the model placeholder left out (the bundled model)."""
    argv = command_argv(find(*LIVE_COMMANDS[name]).text)
    return ["rlt", *(a for a in argv if a != "MODEL"), *extra]


@pytest.mark.slow
@pytest.mark.xdist_group("documented-commands")
@live
def test_rlt_generate_as_the_readme_shows_it():
    argv = live_argv("generate")
    done = subprocess.run(
        [UV, "run", "--no-sync", "--offline", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=OFFLINE,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output
    assert done.stdout.startswith(argv[-1])  # the prompt, then its continuation
    assert re.search(r"^exit depths:( [1-4])+$", done.stdout, re.MULTILINE), done.stdout
    assert "mean loops per decoded token:" in done.stdout and "48 tokens" in done.stdout


class DrainedInFlight(InFlight):
    """A plain request, then at once a stream, both short enough to finish within the default
    10 s drain on a busy CPU: `start` returns once the stream brought text (both in flight)."""

    def start(self) -> None:
        self._run("plain", self._plain, {**self.long, "max_tokens": 2 * STREAM_TOKENS})
        self._run("stream", self._stream, {**self.long, "stream": True})
        assert self.streaming.wait(120), self.results

    def check_drained(self) -> None:
        """Both finished as they would have without the signal."""
        for thread in self.threads:
            thread.join(timeout=120)
            assert not thread.is_alive()
        plain = self.results["plain"]
        assert isinstance(plain, httpx.Response) and plain.status_code == 200, plain
        assert plain.json()["choices"][0]["finish_reason"] == "length", plain.text
        events = self.results["stream"]
        assert isinstance(events, list) and events[-1] == "[DONE]", events
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        assert chunks[-1]["finish_reason"] == "length", events[-3:]
        assert sum(len(c["exit_depths"]) for c in chunks) == STREAM_TOKENS


@pytest.mark.parametrize("server", list(SERVERS), ids=list(SERVERS))
@pytest.mark.slow
@pytest.mark.xdist_group("documented-commands")
@live
def test_a_documented_server_serves_then_drains_on_a_process_group_sigint(server, tmp_path):
    name, extra = SERVERS[server]
    if name == "pd":
        pytest.importorskip("nixl")  # the KV transfer between the instances
    port = free_port()
    launch = Launch(*live_argv(name, "--port", str(port), *extra), port=port)
    try:
        launch.wait_healthy(timeout=300)
        assert launch.output.wait_for(f"ready at http://127.0.0.1:{port}", timeout=30)
        if server == "serve":
            check_documented_clients(launch, port, tmp_path)
        body = {"prompt": "It is a truth", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
        in_flight = DrainedInFlight(launch.base_url, long=body)
        in_flight.start()
        check_stopped_cleanly(launch, launch.signal_group(signal.SIGINT), DRAIN_BOUND_S)
        in_flight.check_drained()
    finally:
        launch.kill()


def check_documented_clients(launch: Launch, port: int, tmp_path: Path) -> None:
    """Against `rlt serve`: the docs' curl commands, `rlt bench serve` as documented (fewer
    prompts), and a prompt refused with 400 that logs no tokenizer warning."""
    curls = [s for path in DOCUMENTS[:-1] for s in snippets(path, re.compile(r"^curl "))]
    assert len(curls) >= 3, curls
    for curl in curls:
        command = re.sub(r"(localhost|127\.0\.0\.1):8000", f"127.0.0.1:{port}", curl.text)
        done = subprocess.run(
            ["bash", "-c", command + " -w '\\n%{http_code}'"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        body, _, status = done.stdout.rpartition("\n")
        assert status == "200", f"{curl.where}: {done.stdout}{done.stderr}"
        assert json.loads(body)["choices"], curl.where
    bench = live_argv("bench", "--port", str(port), "--num-prompts", "4", "--request-rate", "inf")
    bench += ["--random-input-len", "16", "--random-output-len", "4", "--disable-tqdm"]
    bench += ["--result-dir", str(tmp_path)]
    done = subprocess.run(
        [UV, "run", "--no-sync", "--offline", *bench],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=OFFLINE,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Traceback" not in done.stderr
    [saved] = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["completed"] == 4
    with httpx.Client(base_url=launch.base_url, trust_env=False, timeout=60) as http:
        refused = http.post("/v1/completions", json={"prompt": "the river " * 2000})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert not launch.output.has("indexing errors") and not launch.output.has("Token indices")
