"""The served model's files as the coordinator reads them, before any instance starts: the
checkpoint (bundled, a directory or a Hugging Face model id), its tokenizer, and the
`ModelInfo` the front shows (from config.json and the admitted instances)."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlt_contracts import ConfigurationError, FamilyDeclaration, ModelInfo

from rlt_pd_coordinator.cluster import Instance

if TYPE_CHECKING:
    from rlt_models.model_source import ModelSource

logger = logging.getLogger("rlt_pd_coordinator")


def bundled_model_dir() -> Path | None:
    """The rlt engine's bundled model (rlt/default_model), located without importing rlt."""
    spec = importlib.util.find_spec("rlt")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "default_model"
        if (candidate / "config.json").exists():
            return candidate
    return None


def resolve_model(
    model: str | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    tokenizer: bool = True,
) -> ModelSource:
    """The model's files, before any instance starts: the bundled model (None), a checkpoint
    directory, or a Hugging Face model id found in (or downloaded into) the Hugging Face cache
    (`rlt_models.model_source`; an id that cannot be resolved is one `ModelSourceError` line),
    checked for everything the directory lacks (`tokenizer`: its tokenizer files too; False
    when --tokenizer gives the tokenizer apart, as `rlt serve` checks). Local instances get
    its directory: a cache snapshot's path, which they too call by the id."""
    from rlt_models.model_source import ModelSource, resolve_model_source

    if model is None:
        if revision is not None:
            raise ConfigurationError(
                ("revision", "model"),
                "a revision picks a snapshot of a Hugging Face model id; give the id",
            )
        found = bundled_model_dir()
        if found is None:
            raise ConfigurationError(
                "model", "no model directory given and the rlt engine's bundled model is not here"
            )
        return ModelSource(given=str(found), local_dir=found)
    source = resolve_model_source(model, revision=revision, download_dir=download_dir)
    from rlt_models.model_dir import check_model_dir  # (imports torch: after an id resolved)

    local_dir = source.local_dir.resolve()
    check_model_dir(local_dir, tokenizer=tokenizer)  # before any instance starts
    return replace(source, local_dir=local_dir)


def model_facts(
    model_dir: Path, max_model_loops: int | None = None
) -> tuple[int, tuple[int, ...], int, FamilyDeclaration]:
    """(vocab_size, eos_token_ids, num_loops, family) from the checkpoint's config.json, under
    the engines' loop cap `max_model_loops` (None: the family's default); a cap the checkpoint's
    family does not allow is a ConfigurationError naming it."""
    from rlt_models import read_config

    try:
        config = read_config(model_dir)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is a configuration error
        raise ConfigurationError("model", f"cannot read {model_dir}/config.json: {exc}") from None
    try:
        config = read_config(model_dir, max_model_loops=max_model_loops)
    except ConfigurationError as exc:
        raise ConfigurationError(
            "model",
            f"the instances serve a model of {max_model_loops} loops, which {model_dir} cannot "
            f"be ({exc.message}): give the coordinator the instances' model directory",
        ) from None
    shape = config.shape()
    return shape.vocab_size, tuple(shape.eos_token_ids), shape.num_loops, config.declaration()


def load_tokenizer(model_dir: Path):
    from rlt_models import load_tokenizer as load

    try:
        return load(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigurationError("model", f"the front needs the model's tokenizer: {exc}") from None


def build_model_info(
    model_dir: Path, served_name: str | None, instances: list[Instance]
) -> ModelInfo:
    loops = {i.num_loops for i in instances if i.num_loops is not None}
    if len(loops) > 1:
        raise ConfigurationError(
            "model", f"the instances serve models of {sorted(loops)} loops: they must agree"
        )
    # the instances' depth is their loop cap (--max-model-loops): the checkpoint must allow it
    vocab_size, eos, config_loops, family = model_facts(model_dir, next(iter(loops), None))
    names = {i.model_id for i in instances if i.model_id is not None}
    if names - {model_dir.name, served_name}:
        logger.warning(
            "the instances serve %s but the front tokenizes with %s: give the coordinator the "
            "instances' model directory if they differ",
            ", ".join(sorted(names)),
            model_dir,
        )
    lengths = [i.max_model_len for i in instances if i.max_model_len is not None]
    return ModelInfo(
        name=served_name or model_dir.name,
        path=str(model_dir),
        max_model_len=min(lengths) if lengths else 0,
        vocab_size=vocab_size,
        num_loops=config_loops,
        eos_token_ids=eos,
        family=family.name,
        exit_signal=family.exit_signal.value,
        default_loops=family.default_loops,
    )
