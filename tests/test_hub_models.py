"""Models by Hugging Face Hub id (issue 41): `rlt generate`, `rlt serve`, `rlt pd serve` and
`LLM(...)` take `org/name` and find it in the Hugging Face cache, offline.

The cache is written on disk in huggingface_hub's layout under `$HF_HOME/hub`
(`models--org--name/{refs,snapshots,blobs}`, weights from `write_random_checkpoint`):
`main` is one checkpoint (seed 3), the tag `v1` another (seed 4). The commands run as real
processes with `HF_HOME` and `HF_HUB_OFFLINE=1` (huggingface_hub reads them when imported).

- `rlt generate --model org/name` generates; `--revision v1` generates what the seed-4
  directory generates (and not what main does).
- `rlt serve org/name` serves the model as `org/name` (its default served name, as vLLM's);
  `rlt pd serve org/name --revision v1 --replicas 1` too, its instance started on the v1
  snapshot's directory and reporting the same name; `rlt pd serve org/bare --tokenizer org/tok`
  (a checkpoint without tokenizer files, the tokenizer by id) serves the complete model's text.
- An id that is not in the cache fails in under 5 s with exit 2 and one line, for each of
  the three commands (CPU time; wall time scaled by the machine's load).
- Online, against a local Hub (hub_server.py), an id is downloaded with a progress bar,
  only the files rlt reads, and then found offline.
- `LLM("org/name", revision=<commit>, download_dir=<cache>)` loads that snapshot, named
  `org/name`; `LLM(directory, tokenizer="org/tok")` takes the tokenizer from the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rlt import LLM, SamplingParams
from rlt_models.errors import ModelSourceError
from rlt_serve.exit_codes import EXIT_USAGE

COMMIT_MAIN = "3" * 40
COMMIT_V1 = "4" * 40
ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256"]
GENERATE = ["--json", "--max-tokens", "6", "--ignore-eos"]
UNRESOLVED = (
    "'org/unknown' is neither a local directory nor in the Hugging Face cache {cache} at "
    "revision main, and HF_HUB_OFFLINE forbids downloading it"
)


def write_hub_cache(cache: Path, hub_id: str, snapshots: dict[str, Path], refs: dict) -> None:
    """`hub_id` in huggingface_hub's cache layout: each snapshot (commit -> checkpoint
    directory) links its files to content-addressed blobs; each ref names a commit."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for commit, source in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in sorted(source.iterdir()):
            data = file.read_bytes()
            blob = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    for ref, commit in refs.items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_checkpoint) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    write_hub_cache(
        home / "hub",
        "org/name",
        {
            COMMIT_MAIN: tiny_checkpoint(seed=3, gate_std=0.3),
            COMMIT_V1: tiny_checkpoint(seed=4, gate_std=0.3),
        },
        {"main": COMMIT_MAIN, "v1": COMMIT_V1},
    )
    return home


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "RLT_API_KEY")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def rlt(hf_home: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlt.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=offline_env(hf_home),
    )


def generated(done: subprocess.CompletedProcess) -> tuple[list[int], list[int]]:
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout.strip().splitlines()[-1])
    return output["token_ids"], output["exit_depths"]


def test_rlt_generate_runs_an_id_and_its_revision_from_the_cache(hf_home, tiny_checkpoint):
    main = generated(rlt(hf_home, "generate", "--model", "org/name", *ENGINE, *GENERATE, "It is"))
    v1 = rlt(
        hf_home, "generate", "--model", "org/name", "--revision", "v1", *ENGINE, *GENERATE, "It is"
    )
    seed_4 = str(tiny_checkpoint(seed=4, gate_std=0.3))
    directory = rlt(hf_home, "generate", "--model", seed_4, *ENGINE, *GENERATE, "It is")
    assert len(main[0]) == 6
    assert generated(v1) == generated(directory)
    assert generated(v1) != main


@contextlib.contextmanager
def server(hf_home: Path, *argv: str) -> Iterator[tuple[httpx.Client, subprocess.Popen]]:
    """`rlt ARGV --port P` until /health answers; SIGINT at the end, which must exit 0."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rlt.cli", *argv, "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=offline_env(hf_home),
    )
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                if http.get("/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        yield http, process
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        http.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def check_serves_as_the_id(http: httpx.Client) -> None:
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == "org/name"
    body = {"model": "org/name", "prompt": "It is", "max_tokens": 4, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "org/name"
    assert len(response.json()["choices"][0]["exit_depths"]) == 4


def test_rlt_serve_serves_an_id_under_its_name(hf_home):
    with server(hf_home, "serve", "org/name", *ENGINE) as (http, _):
        check_serves_as_the_id(http)


def test_rlt_pd_serve_resolves_the_revision_once_and_its_instance_loads_that_snapshot(hf_home):
    snapshot = hf_home / "hub" / "models--org--name" / "snapshots" / COMMIT_V1
    argv = ["pd", "serve", "org/name", "--revision", "v1", "--replicas", "1", *ENGINE]
    with server(hf_home, *argv) as (http, process):
        check_serves_as_the_id(http)
        (instance,) = http.get("/v1/pd/instances").json()["instances"]
        assert instance["state"] == "ready"
    output = process.stdout.read()
    (started,) = [line for line in output.splitlines() if "started replica-0" in line]
    assert f"rlt.cli serve {snapshot} " in started  # the snapshot, never the id again
    assert "the instances serve" not in output  # no name mismatch between front and instance


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "org/unknown", "It is"],
        ["serve", "org/unknown"],
        ["pd", "serve", "org/unknown", "--replicas", "1"],
    ],
    ids=["generate", "serve", "pd serve"],
)
def test_an_unknown_id_fails_in_under_5_s_with_one_line(hf_home, argv):
    """Under 5 s of the command's own CPU time, and of wall time scaled by how oversubscribed
    the cores are (this 2-core machine runs other test workers meanwhile: about 2 s when idle,
    6 s seen at a load of 7.6); a wait for the network would show in the wall time alone."""
    cpu_before = _children_cpu_s()
    started = time.monotonic()
    done = rlt(hf_home, *argv, "--device", "cpu", timeout=60)
    elapsed = time.monotonic() - started
    cpu = _children_cpu_s() - cpu_before
    assert done.returncode == EXIT_USAGE, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    prog = "rlt pd" if argv[0] == "pd" else "rlt"
    assert lines[0] == f"{prog}: error: model: " + UNRESOLVED.format(cache=hf_home / "hub")
    oversubscribed = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert cpu < 5.0, f"{cpu:.1f} s of CPU"
    assert elapsed < 5.0 * oversubscribed, f"{elapsed:.1f} s at a load of {oversubscribed:.1f}x"


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_an_id_is_downloaded_with_progress_then_found_offline(tmp_path):
    """Online (a local Hub at HF_ENDPOINT, hub_server.py): `rlt generate --model org/name`
    downloads the snapshot into an empty HF_HOME with huggingface_hub's progress bar on stderr,
    fetching only the files rlt reads (no PyTorch .bin, nothing in subfolders, no code);
    then, with HF_HUB_OFFLINE=1, the same id is found in the cache without asking the Hub."""
    from hub_server import HubRepository, hub_server
    from rlt.engine.assembly import DEFAULT_MODEL_DIR

    files = {f.name: f.read_bytes() for f in DEFAULT_MODEL_DIR.iterdir() if f.is_file()}
    unread = {name: b"x" for name in ("pytorch_model.bin", "original/model.safetensors", "x.py")}
    repository = HubRepository("org/name", COMMIT_MAIN, {**files, **unread})
    home = tmp_path / "hf_home"
    argv = ["generate", "--model", "org/name", *ENGINE, *GENERATE, "It is"]
    with hub_server(repository) as endpoint:
        env = {**offline_env(home), "HF_ENDPOINT": endpoint}
        del env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]
        env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        command = [sys.executable, "-m", "rlt.cli", *argv]
        online = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        asked = len(repository.requests)
        offline = rlt(home, *argv)
    assert len(repository.requests) == asked  # offline: the Hub is not asked again
    resolve = f"/resolve/{COMMIT_MAIN}/"
    fetched = {line.split(resolve)[1] for line in repository.requests if resolve in line}
    assert fetched == set(files)
    assert "100%" in online.stderr and f"{len(files)}/{len(files)}" in online.stderr, online.stderr
    snapshot = home / "hub" / "models--org--name" / "snapshots" / COMMIT_MAIN
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(files)
    assert generated(online) == generated(offline)


def test_llm_loads_an_id_at_a_commit_under_its_name(hf_home, tiny_checkpoint):
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM("org/name", revision=COMMIT_V1, download_dir=hf_home / "hub", **options) as llm:
        info = llm.engine.model_info()
        by_id = llm.generate([[5, 17, 200, 3]], params)[0]
    assert info.name == "org/name"
    assert Path(info.path) == hf_home / "hub" / "models--org--name" / "snapshots" / COMMIT_V1
    with LLM(tiny_checkpoint(seed=4, gate_std=0.3), **options) as llm:
        by_directory = llm.generate([[5, 17, 200, 3]], params)[0]
    assert (by_id.token_ids, by_id.exit_depths) == (
        by_directory.token_ids,
        by_directory.exit_depths,
    )


def split_bundled_model(tmp_path: Path) -> tuple[Path, Path]:
    """The bundled model's files in two directories: a checkpoint without tokenizer files
    (config and weights) and the tokenizer alone."""
    from rlt.engine.assembly import DEFAULT_MODEL_DIR

    bare, tokenizer_files = tmp_path / "bare", tmp_path / "tokenizer"
    bare.mkdir()
    tokenizer_files.mkdir()
    for file in DEFAULT_MODEL_DIR.iterdir():
        if file.is_file():
            weights = file.name in ("config.json", "model.safetensors")
            shutil.copy(file, bare if weights else tokenizer_files)
    return bare, tokenizer_files


def test_llm_takes_a_tokenizer_by_id(tmp_path):
    """`LLM(model, tokenizer="org/tok")`: the tokenizer's files from the cache, for a checkpoint
    directory that holds none; text in, the same text out as the complete model directory."""
    from rlt.engine.assembly import DEFAULT_MODEL_DIR

    bare, tokenizer_files = split_bundled_model(tmp_path)
    cache = tmp_path / "hub"
    write_hub_cache(cache, "org/tok", {COMMIT_MAIN: tokenizer_files}, {"main": COMMIT_MAIN})
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(bare, tokenizer="org/tok", download_dir=cache, **options) as llm:
        by_id = llm.generate(["It is a truth"], params)[0]
    with LLM(DEFAULT_MODEL_DIR, **options) as llm:
        whole = llm.generate(["It is a truth"], params)[0]
    assert (by_id.prompt_token_ids, by_id.text) == (whole.prompt_token_ids, whole.text)
    with pytest.raises(ModelSourceError, match="tokenizer: 'org/absent' is neither"):
        LLM(bare, tokenizer="org/absent", download_dir=cache, **options)


def test_the_command_line_pins_the_snapshot_for_every_process_it_starts(hf_home):
    """`rlt generate` / `rlt serve` resolve the id once: their engine configuration names the
    snapshot's directory, no revision left to resolve again, and --tokenizer's id likewise."""
    from rlt.cli import build_parser, engine_config_from_args, resolve_model_argument

    cache = hf_home / "hub"
    argv = ["serve", "org/name", "--revision", "v1", "--download-dir", str(cache)]
    args = build_parser().parse_args(argv)
    args.model, args.tokenizer = args.model_dir, "org/name"  # (as `--tokenizer org/name`)
    resolve_model_argument(args)
    snapshots = cache / "models--org--name" / "snapshots"
    assert (args.model, args.revision) == (str(snapshots / COMMIT_V1), None)
    assert args.tokenizer == str(snapshots / COMMIT_MAIN)  # a tokenizer's id: its main
    config = engine_config_from_args(args)
    assert (config.model.model, config.model.revision) == (str(snapshots / COMMIT_V1), None)


def test_rlt_pd_serve_takes_a_weights_only_id_and_its_tokenizer_by_id(tmp_path):
    """`rlt pd serve org/bare --tokenizer org/tok --replicas 1`: a checkpoint id without tokenizer
    files (not refused for lacking them, as `rlt serve` does not) and the tokenizer by another id,
    each resolved once by the coordinator; its instance gets the two snapshots' directories; text
    in, the same text and loops out as the complete model in-process. An unknown tokenizer id
    fails in one line before any instance starts."""
    from rlt.engine.assembly import DEFAULT_MODEL_DIR

    bare, tokenizer_files = split_bundled_model(tmp_path)
    home = tmp_path / "hf_home"
    for hub_id, files in (("org/bare", bare), ("org/tok", tokenizer_files)):
        write_hub_cache(home / "hub", hub_id, {COMMIT_MAIN: files}, {"main": COMMIT_MAIN})
    snapshots = {
        name: home / "hub" / f"models--org--{name}" / "snapshots" / COMMIT_MAIN
        for name in ("bare", "tok")
    }
    prompt, loops = "It is a truth", {"exit_threshold": 0.5}
    argv = ["pd", "serve", "org/bare", "--tokenizer", "org/tok", "--replicas", "1", *ENGINE]
    with server(home, *argv) as (http, process):
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0, **loops}
        response = http.post("/v1/completions", json={"model": "org/bare", **body})
        assert response.status_code == 200, response.text
        (served,) = response.json()["choices"]
    started = [line for line in process.stdout.read().splitlines() if "started replica-0" in line]
    assert f"rlt.cli serve {snapshots['bare']} " in started[0]
    assert f"--tokenizer {snapshots['tok']}" in started[0]  # the snapshot, never the id again
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    with LLM(DEFAULT_MODEL_DIR, **options) as llm:
        whole = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, **loops))[0]
    assert (served["text"], served["exit_depths"]) == (whole.text, list(whole.exit_depths))

    done = rlt(home, "pd", "serve", "org/bare", "--tokenizer", "org/absent", "--replicas", "1")
    assert done.returncode == EXIT_USAGE, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert error.startswith("rlt pd: error: tokenizer: 'org/absent' is neither"), done.stderr
    assert "started" not in done.stderr
