"""What a checkpoint directory must hold, checked before anything loads, so that a wrong or
incomplete directory fails at once with every missing piece named (config.json, the weights,
the tokenizer's files) instead of deep inside loading (a bare "not found", or transformers'
advice to install sentencepiece for a directory that holds no tokenizer at all)."""

from __future__ import annotations

from pathlib import Path

from rlt_contracts import ConfigurationError

from rlt_models.safetensors_files import INDEX_FILE, SINGLE_FILE

CONFIG_FILE = "config.json"
# Any of these sets is a tokenizer transformers loads offline: the fast tokenizer's one file,
# a sentencepiece model, or a byte-level BPE's vocabulary and merges (Qwen / Ouro releases).
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def missing_model_files(model_dir: str | Path, *, tokenizer: bool = True) -> list[str]:
    """The pieces of a checkpoint directory that `model_dir` lacks, in words (empty: none);
    `tokenizer=False` for callers that only run token ids."""
    path = Path(model_dir)
    missing = []
    if not (path / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()):
        missing.append(f"the weights ({SINGLE_FILE}, or {INDEX_FILE} and its shards)")
    if tokenizer and not has_tokenizer_files(path):
        missing.append(_TOKENIZER_FILES)
    return missing


def has_tokenizer_files(directory: str | Path) -> bool:
    path = Path(directory)
    return any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS)


_TOKENIZER_FILES = "the tokenizer ({} or {})".format(
    ", ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS[:-1]),
    " + ".join(TOKENIZER_FILE_SETS[-1]),
)


def check_tokenizer_dir(directory: str | Path) -> None:
    """Raise `ConfigurationError("tokenizer", ...)` unless `directory` holds a tokenizer
    (a tokenizer given apart from the checkpoint: vLLM's --tokenizer)."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigurationError(
            "tokenizer", f"{str(directory)!r} is not a directory (give a tokenizer's directory)"
        )
    if not has_tokenizer_files(path):
        raise ConfigurationError(
            "tokenizer", f"{path} holds no tokenizer; it lacks {_TOKENIZER_FILES}"
        )


def check_model_dir(model_dir: str | Path, *, tokenizer: bool = True) -> None:
    """Raise `ConfigurationError("model", ...)` naming everything `model_dir` lacks."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigurationError(
            "model", f"{str(model_dir)!r} is not a directory (give a local checkpoint directory)"
        )
    missing = missing_model_files(path, tokenizer=tokenizer)
    if missing:
        raise ConfigurationError(
            "model", f"{path} is not a complete checkpoint directory; it lacks {'; '.join(missing)}"
        )
