"""Where a model's files come from: a local checkpoint directory, or a Hugging Face Hub id
(`org/name`) resolved to its snapshot in the Hugging Face cache through `huggingface_hub`.

The rule, as vLLM's: a path that exists is a local directory and wins; anything else that is a
valid Hub id is looked up with `huggingface_hub.snapshot_download` (online, the Hub says which
commit a branch or tag is now; offline, the cache's `refs/<revision>` does), with its progress
bars on stderr (off with `HF_HUB_DISABLE_PROGRESS_BARS=1`). README.md, "Models by Hugging Face
id", gives the arguments, the files fetched, the errors and a worked example.

A snapshot directory of a Hugging Face cache (`.../models--org--name/snapshots/<commit>`) is a
local directory that knows its id: its `ModelSource.name` is `org/name`, as the id's. So a
command resolves an id once and hands its processes (an engine core, PD instances) the
snapshot's path: they read that one snapshot, and still call the model `org/name`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from rlt_contracts import ConfigurationError

from rlt_models.errors import ModelSourceError

logger = logging.getLogger(__name__)

# The files rlt reads from a checkpoint directory (model_dir.py; the tokenizer's files and
# chat templates included), at the repository's top level only: no PyTorch .bin weights, no
# `original/` copies, no checkpoint code (rlt never runs it).
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")
# A tokenizer given by id (--tokenizer) needs no weights.
TOKENIZER_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja")
HUB_IGNORED_PATTERNS = ("*/*",)
DEFAULT_REVISION = "main"
CACHE_REPO_PREFIX = "models--"  # a model's folder in the cache: models--org--name
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument.

    given: the model argument as the user gave it (a directory or a Hub id).
    local_dir: the checkpoint directory to read (for a Hub id: its snapshot in the cache).
    hub_id: the Hugging Face Hub repository id: the one resolved, or the one a cache snapshot
      directory belongs to; None for any other directory.
    commit: the snapshot's commit hash (with hub_id).
    """

    given: str
    local_dir: Path
    hub_id: str | None = None
    commit: str | None = None

    @property
    def name(self) -> str:
        """The model's default served name: the Hub id as given (vLLM's default), else the
        directory's name."""
        return self.hub_id if self.hub_id is not None else self.local_dir.name


def resolve_model_source(
    model: str | Path,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    option: str = "model",
    file_patterns: tuple[str, ...] = HUB_FILE_PATTERNS,
) -> ModelSource:
    """`model` as a local directory (it exists) or a Hub id resolved to a cached snapshot,
    downloading it unless `HF_HUB_OFFLINE` is set (see the module docstring). Raises
    `ModelSourceError` for an id that cannot be resolved, `ConfigurationError` for an
    argument that is neither, or a `revision` given with a local directory; `option` is the
    option the errors name, `file_patterns` the files an id's snapshot gets (a tokenizer given
    by id: `option="tokenizer"`, `file_patterns=TOKENIZER_FILE_PATTERNS`)."""
    given = str(model)
    path = Path(given).expanduser()
    if path.exists():
        if revision is not None:
            raise ConfigurationError(
                (option, "revision"),
                f"a revision picks a snapshot of a Hugging Face model id; {given!r} is a local "
                "directory",
            )
        return ModelSource(given=given, local_dir=path, **_cached_identity(path))
    if not is_hub_id(given):
        raise ConfigurationError(
            option,
            f"{given!r} is not a directory (give a local checkpoint directory or a Hugging Face "
            "model id such as org/name)",
        )
    return _snapshot(given, revision, download_dir, option, file_patterns)


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hub repository id (`name` or `org/name`), not of a
    path (`/...`, `./...`, `~...`)."""
    if not text or text.startswith(_PATH_PREFIXES):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def tokenizer_snapshot(tokenizer: str | Path, *, download_dir: str | Path | None = None):
    """A tokenizer given apart from the checkpoint (--tokenizer) as a Hub id, not a path that
    exists: its `main` snapshot of the tokenizer's files (`TOKENIZER_FILE_PATTERNS`), found in
    or downloaded into the cache `download_dir`; None for a path."""
    given = str(tokenizer)
    if Path(given).expanduser().exists() or not is_hub_id(given):
        return None
    source = resolve_model_source(
        given, download_dir=download_dir, option="tokenizer", file_patterns=TOKENIZER_FILE_PATTERNS
    )
    return source.local_dir


def resolve_tokenizer_dir(
    tokenizer: str | Path | None, *, download_dir: str | Path | None = None
) -> Path | None:
    """The directory of a tokenizer given apart from the checkpoint (--tokenizer,
    EngineConfig.tokenizer): `tokenizer_snapshot`'s, else the directory given, checked to hold
    a tokenizer (`model_dir.check_tokenizer_dir`); None when none was given."""
    if tokenizer is None:
        return None
    from rlt_models.model_dir import check_tokenizer_dir

    path = tokenizer_snapshot(tokenizer, download_dir=download_dir) or Path(tokenizer).expanduser()
    check_tokenizer_dir(path)
    return path


def _cached_identity(path: Path) -> dict[str, str]:
    """{hub_id, commit} of a snapshot directory of a Hugging Face cache
    (`models--org--name/snapshots/<commit>`; ids never hold `--`), else {}."""
    resolved = path.resolve()
    repo = resolved.parent.parent.name
    if resolved.parent.name != "snapshots" or not repo.startswith(CACHE_REPO_PREFIX):
        return {}
    hub_id = repo.removeprefix(CACHE_REPO_PREFIX).replace("--", "/")
    if not is_hub_id(hub_id):
        return {}
    return {"hub_id": hub_id, "commit": resolved.name}


def _snapshot(
    hub_id: str,
    revision: str | None,
    download_dir: str | Path | None,
    option: str,
    file_patterns: tuple[str, ...],
) -> ModelSource:
    from huggingface_hub import constants, snapshot_download

    wanted = revision or DEFAULT_REVISION
    cache = Path(download_dir).expanduser() if download_dir is not None else None
    where = cache if cache is not None else Path(constants.HF_HUB_CACHE)
    try:
        folder = snapshot_download(
            hub_id,
            revision=wanted,
            cache_dir=cache,
            allow_patterns=list(file_patterns),
            ignore_patterns=list(HUB_IGNORED_PATTERNS),
        )
    except Exception as exc:  # noqa: BLE001 - every failure becomes one typed line
        raise _source_error(hub_id, wanted, where, exc, option) from None
    local_dir = Path(folder)
    commit = local_dir.name if _COMMIT.fullmatch(local_dir.name) else None
    logger.info("model %s: revision %s = commit %s in %s", hub_id, wanted, commit, local_dir)
    return ModelSource(given=hub_id, local_dir=local_dir, hub_id=hub_id, commit=commit)


def _source_error(
    hub_id: str, revision: str, cache: Path, exc: Exception, option: str
) -> ModelSourceError:
    """One line saying why `hub_id` at `revision` cannot be had (huggingface_hub's messages
    span several lines and advise on its own options)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    model = f"{hub_id!r} (revision {revision})"
    if isinstance(exc, IncompleteSnapshotError):
        why = f"its snapshot in {cache} is incomplete and the Hub cannot be reached to finish it"
        return ModelSourceError((option, "revision"), f"{model}: {why}")
    if isinstance(exc, LocalEntryNotFoundError):
        nowhere = (
            f"{hub_id!r} is neither a local directory nor in the Hugging Face cache {cache} at "
            f"revision {revision}"
        )
        if constants.is_offline_mode():
            return ModelSourceError(option, f"{nowhere}, and HF_HUB_OFFLINE forbids downloading it")
        cause = exc.__cause__
        reason = f" ({type(cause).__name__})" if cause is not None else ""
        return ModelSourceError(
            option, f"{nowhere}, and the Hugging Face Hub cannot be reached{reason}"
        )
    if isinstance(exc, GatedRepoError):
        why = "is gated: accept its terms on huggingface.co and set HF_TOKEN"
        return ModelSourceError(option, f"{model} {why}")
    if isinstance(exc, RepositoryNotFoundError):
        why = (
            "is neither a local directory nor a model on the Hugging Face Hub (a private one "
            "needs HF_TOKEN)"
        )
        return ModelSourceError(option, f"{hub_id!r} {why}")
    if isinstance(exc, RevisionNotFoundError):
        return ModelSourceError("revision", f"{hub_id!r} has no revision {revision!r} on the Hub")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return ModelSourceError(option, f"{model}: the Hugging Face Hub answered HTTP {status}")
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return ModelSourceError(option, f"{model}: {type(exc).__name__}: {first_line}")
