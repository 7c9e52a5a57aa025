"""Export a runtime model of any registered family as its Hugging Face checkpoint directory.

The inverse of `build_model`: each runtime parameter is split back into the checkpoint tensors
the family fuses into it (`Family.parameter_sources`: Ouro's and Nanbeige's q/k/v and gate/up;
HRM-Text's are stored fused), and every tensor gets its exact Hugging Face name; a tied head
is not written (the checkpoint holds only the embedding, as transformers saves it). `load_model`
on the written directory gives back the same parameters.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlt_models.families import family_of
from rlt_models.fp8 import Fp8Projection
from rlt_models.loading import DTYPES
from rlt_models.looped_model import LoopedModelBase
from rlt_models.safetensors_files import SINGLE_FILE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoint_tensors(model: LoopedModelBase) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor by its Hugging Face name, in checkpoint order.

    The tensors are detached views of the model's parameters (same device and dtype): e.g.
    q/k/v are row blocks of `qkv_proj` [q + 2 kv, d], gate/up of `gate_up_proj` [2 f, d]. An fp8
    projection is exported dequantized to the model dtype (the values its reference path
    multiplies by), so the written checkpoint is the fp8 model's exact float twin.
    """
    family = family_of(model.config)
    shapes = family.tensor_shapes(model.config)
    params = dict(model.named_parameters())
    projections = {
        name: module for name, module in model.named_modules() if isinstance(module, Fp8Projection)
    }
    tensors: dict[str, torch.Tensor] = {}
    for param_name, names in family.parameter_sources(model.config).items():
        if any(name in tensors for name in names):
            continue  # a tied head reads the embedding, written already under its own name
        rows = [shapes[name][0] for name in names]
        if param_name in projections:
            weight = projections[param_name].dequantized(model.dtype)
        else:
            weight = params[param_name].detach()
        parts = weight.split(rows, dim=0)
        tensors.update(zip(names, parts, strict=True))
    return {name: tensors[name] for name in shapes}


def save_checkpoint(
    model: LoopedModelBase,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write config.json, model.safetensors and (if given) the tokenizer files; return the dir.

    dtype: storage dtype of the weights ("float32", "bfloat16", "float16"), also written as
      the config's torch_dtype. tokenizer_dir: a directory holding tokenizer.json (required)
      and, where present, tokenizer_config.json and special_tokens_map.json, copied as is.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    tokenizer_sources: list[Path] = []
    if tokenizer_dir is not None:
        source = Path(tokenizer_dir)
        if not (source / TOKENIZER_FILES[0]).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILES[0]} in {source}")
        tokenizer_sources = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    # copy=True: the q/k/v (gate/up) views share one storage, which safetensors refuses.
    tensors = {
        name: tensor.to(device="cpu", dtype=DTYPES[dtype], copy=True).contiguous()
        for name, tensor in checkpoint_tensors(model).items()
    }
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    for path in tokenizer_sources:
        shutil.copyfile(path, out / path.name)
    return out
