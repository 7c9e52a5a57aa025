"""Models by Hugging Face Hub id (`rlt_models.model_source`), resolved offline from a cache
written on disk in huggingface_hub's own layout: `models--org--name/refs/<ref>` holds a commit,
`snapshots/<commit>/<file>` links to `blobs/<hash>` (tests run with HF_HUB_OFFLINE=1, the root
conftest's; no network here).

- An id resolves to the snapshot its `refs/main` names; `revision` picks another snapshot by
  ref (a tag) or by commit; the name is the id as given; a snapshot's path names itself too.
- A path that exists wins over an id; a revision with a local directory, a path-like argument
  that does not exist, an id not in the cache (or a revision it lacks) are typed errors of one
  line, the last in well under a second.
- `HF_HOME` is where the cache is when no download directory is given; with the Hub
  unreachable (online) a cached id still resolves and an uncached one says why in one line
  (each in a process of its own: huggingface_hub reads its environment when imported).
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlt_contracts import ConfigurationError
from rlt_models.errors import ModelSourceError
from rlt_models.model_source import ModelSource, is_hub_id, resolve_model_source

COMMIT_MAIN = "1" * 40
COMMIT_V1 = "2" * 40


def write_hub_cache(cache: Path, hub_id: str, snapshots: dict[str, Path], refs: dict) -> Path:
    """The cache layout of `hub_id`: each snapshot (commit -> checkpoint directory) as links
    into content-addressed blobs (sha256 for weights, as LFS files; git's sha1 for the rest),
    and refs (name -> commit). Returns the repository's folder."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, source in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in sorted(source.iterdir()):
            data = file.read_bytes()
            if file.suffix == ".safetensors":
                blob = hashlib.sha256(data).hexdigest()
            else:
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return repo


@pytest.fixture
def cache(tmp_path, tiny_checkpoint) -> Path:
    """org/name: main -> COMMIT_MAIN (seed 0), tag v1 -> COMMIT_V1 (seed 1)."""
    root = tmp_path / "hub"
    write_hub_cache(
        root,
        "org/name",
        {COMMIT_MAIN: tiny_checkpoint(seed=0), COMMIT_V1: tiny_checkpoint(seed=1)},
        {"main": COMMIT_MAIN, "v1": COMMIT_V1},
    )
    return root


def snapshot_dir(cache: Path, commit: str) -> Path:
    return cache / "models--org--name" / "snapshots" / commit


def test_an_id_resolves_to_the_snapshot_of_main_and_keeps_its_name(cache):
    source = resolve_model_source("org/name", download_dir=cache)
    assert source == ModelSource(
        given="org/name",
        local_dir=snapshot_dir(cache, COMMIT_MAIN),
        hub_id="org/name",
        commit=COMMIT_MAIN,
    )
    assert source.name == "org/name"
    assert (source.local_dir / "config.json").is_file()


@pytest.mark.parametrize("revision", ["v1", COMMIT_V1], ids=["tag", "commit"])
def test_a_revision_picks_a_snapshot_by_ref_or_commit(cache, revision, tiny_checkpoint):
    source = resolve_model_source("org/name", revision=revision, download_dir=cache)
    assert source.local_dir == snapshot_dir(cache, COMMIT_V1)
    assert source.commit == COMMIT_V1 and source.name == "org/name"
    weights = (source.local_dir / "model.safetensors").read_bytes()
    assert weights == (tiny_checkpoint(seed=1) / "model.safetensors").read_bytes()


def test_a_snapshot_directory_names_itself_by_its_id(cache):
    source = resolve_model_source(snapshot_dir(cache, COMMIT_V1))
    assert (source.hub_id, source.commit, source.name) == ("org/name", COMMIT_V1, "org/name")


def test_a_path_that_exists_wins_over_the_id_of_the_same_name(cache, tmp_path, monkeypatch):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    source = resolve_model_source("org/name", download_dir=cache)
    assert source == ModelSource(given="org/name", local_dir=Path("org/name"))
    assert source.name == "name"  # a plain directory is named by its name, as before


def test_an_id_not_in_the_cache_fails_at_once_in_one_line(cache):
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as error:
        resolve_model_source("org/unknown", download_dir=cache)
    assert time.monotonic() - started < 1.0
    message = str(error.value)
    assert message == (
        f"model: 'org/unknown' is neither a local directory nor in the Hugging Face cache "
        f"{cache} at revision main, and HF_HUB_OFFLINE forbids downloading it"
    )
    assert isinstance(error.value, ConfigurationError) and error.value.options == ("model",)


def test_a_revision_the_cache_lacks_is_named(cache):
    with pytest.raises(ModelSourceError, match="at revision v2, and HF_HUB_OFFLINE forbids"):
        resolve_model_source("org/name", revision="v2", download_dir=cache)


def test_a_tokenizer_given_by_id_names_its_option(cache):
    with pytest.raises(ModelSourceError) as error:
        resolve_model_source("org/unknown", download_dir=cache, option="tokenizer")
    assert error.value.options == ("tokenizer",)


def test_a_revision_with_a_local_directory_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigurationError) as error:
        resolve_model_source(tiny_checkpoint(), revision="main")
    assert error.value.options == ("model", "revision")
    assert "is a local directory" in str(error.value)


@pytest.mark.parametrize("given", ["./missing", "/no/such/dir", "~/no-such-dir", "a/b/c"])
def test_a_missing_path_that_is_no_id_is_not_a_directory(given):
    with pytest.raises(ConfigurationError) as error:
        resolve_model_source(given)
    assert not isinstance(error.value, ModelSourceError)
    assert f"{given!r} is not a directory" in str(error.value)
    assert "Hugging Face model id such as org/name" in str(error.value)


def test_what_counts_as_an_id():
    assert is_hub_id("org/name") and is_hub_id("name") and is_hub_id("Org-1/na.me_2")
    for text in ("", "/abs", "./rel", "../up", "~/home", "a/b/c", "org/na me", "org--x/y"):
        assert not is_hub_id(text), text


def child_env(**variables: str) -> dict[str, str]:
    """This environment without the Hugging Face cache and offline variables, plus
    `variables` (huggingface_hub reads them when it is imported: hence a child process)."""
    env = dict(os.environ)
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        env.pop(name, None)
    env.pop("TRANSFORMERS_OFFLINE", None)  # huggingface_hub reads it as HF_HUB_OFFLINE
    return {**env, **variables}


def resolve_in_a_process(env: dict[str, str], model: str) -> subprocess.CompletedProcess:
    """`resolve_model_source(model)` in a child: its directory on stdout, or its error on
    stderr and exit 2."""
    code = (
        "import sys\n"
        "from rlt_contracts import RltError\n"
        "from rlt_models.model_source import resolve_model_source\n"
        "try:\n"
        "    print(resolve_model_source(sys.argv[1]).local_dir)\n"
        "except RltError as exc:\n"
        "    sys.exit(print(exc, file=sys.stderr) or 2)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, model], capture_output=True, text=True, timeout=60, env=env
    )


def test_hf_home_is_the_default_cache(tmp_path, tiny_checkpoint):
    home = tmp_path / "hf_home"
    write_hub_cache(
        home / "hub", "org/name", {COMMIT_MAIN: tiny_checkpoint()}, {"main": COMMIT_MAIN}
    )
    done = resolve_in_a_process(child_env(HF_HOME=str(home), HF_HUB_OFFLINE="1"), "org/name")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == home / "hub" / "models--org--name/snapshots" / COMMIT_MAIN


def test_online_with_the_hub_unreachable_a_cached_id_resolves_and_another_says_why(cache):
    with socket.socket() as closed:  # a port nobody listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = child_env(HF_HUB_CACHE=str(cache), HF_ENDPOINT=endpoint)
    found = resolve_in_a_process(env, "org/name")
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == snapshot_dir(cache, COMMIT_MAIN)
    missing = resolve_in_a_process(env, "org/unknown")
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"model: 'org/unknown' is neither a local directory nor in the Hugging Face cache "
        f"{cache} at revision main, and the Hugging Face Hub cannot be reached (ConnectError)"
    )
