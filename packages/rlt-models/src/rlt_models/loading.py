"""Strict loading of an Ouro checkpoint directory (config.json + safetensors + tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rlt_models.config import OuroConfig
from rlt_models.errors import CheckpointError
from rlt_models.ouro import OuroModel
from rlt_models.weights import checkpoint_tensor_shapes, parameter_sources

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, config: OuroConfig) -> torch.dtype:
    """`None` or "auto" means the checkpoint's `torch_dtype`."""
    if dtype is None or dtype == "auto":
        return DTYPES[config.torch_dtype]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise CheckpointError(f"dtype {dtype} unsupported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} unsupported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


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


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> OuroModel:
    """Build `OuroModel` from a checkpoint directory, checking names and shapes strictly.

    Missing, unexpected or mis-shaped tensors raise `CheckpointError` naming the tensor.
    """
    model_dir = Path(model_dir)
    config = OuroConfig.from_pretrained(model_dir)
    target_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    tensors = dict(iter_checkpoint_tensors(model_dir, device="cpu"))
    return build_model(config, tensors, dtype=target_dtype, device=device, source=str(model_dir))


def build_model(
    config: OuroConfig,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    source: str = "checkpoint",
) -> OuroModel:
    """`OuroModel` from checkpoint tensors keyed by their Hugging Face names (checked strictly;
    q/k/v and gate/up are fused here). `tensors` is not modified."""
    expected = checkpoint_tensor_shapes(config)
    for name, tensor in tensors.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in {source} (not an Ouro weight)")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has non-float dtype {tensor.dtype}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor(s) {shown}{more} in {source}")
    with torch.device(device):
        model = OuroModel(config).to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param_name, source_names in parameter_sources(config).items():
            merged = torch.cat([tensors[name] for name in source_names], dim=0)
            params[param_name].copy_(merged.to(device=device, dtype=dtype))
    return model.eval()


def _open(path: Path, device: str = "cpu") -> ExitStack:
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
