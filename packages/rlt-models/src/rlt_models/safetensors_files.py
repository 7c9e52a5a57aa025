"""The safetensors files of a checkpoint directory: one `model.safetensors`, or shards listed by
`model.safetensors.index.json` (Hugging Face's layout), and reading every tensor they hold.

Loading (`loading.py`), the fp8 checkpoint writer (`fp8_checkpoint.py`) and the directory check
(`model_dir.py`) read checkpoints through this module; the writers name their files by it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rlt_models.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the single file or the sharded index."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: malformed index ({exc})") from exc
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(f"{index_path} names shard {shard.name}, which is missing")
        return files
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with _open(single) as handle:
        return {name: single for name in handle.keys()}


def iter_checkpoint_tensors(
    model_dir: Path, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, in its stored dtype."""
    files = checkpoint_files(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with _open(path, device) as handle:
            available = set(handle.keys())
            for name in names:
                if name not in available:
                    raise CheckpointError(
                        f"tensor {name!r} is listed for {path.name} but not in it"
                    )
                try:
                    yield name, handle.get_tensor(name)
                except SafetensorError as exc:
                    raise CheckpointError(f"{path}: cannot read tensor {name!r}: {exc}") from exc


def _open(path: Path, device: str = "cpu") -> ExitStack:
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
