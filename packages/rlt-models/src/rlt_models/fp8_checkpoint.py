"""FP8 checkpoints of any registered family in the compressed-tensors "float-quantized" format
(what llm-compressor writes for vLLM's FP8 schemes): reading the scheme from config.json, the
tensors it implies, and writing such a checkpoint from a bf16/fp32 one.

Supported: one config group of 8-bit float weights, symmetric, per output channel
(`strategy: channel`), static (stored) weight scales, with activations unquantized or quantized
dynamically per token (the weights are the same either way; rlt chooses its own activation
path). Each quantized `<module>.weight` is float8_e4m3fn [N, K] beside `<module>.weight_scale`
[N, 1] (or [N]) in a float dtype. The quantized tensors are the checkpoint tensors of the
family's projections (the runtime parameters named in `PROJECTION_PARAMETERS`: Ouro's and
Nanbeige's q/k/v/o and gate/up/down, HRM-Text's fused `gqkv_proj`, `o_proj`, `gate_up_proj`
and `down_proj`), the LM head too unless `ignore` names it (a tied head is the embedding,
never stored as fp8: it is quantized at load when asked); embeddings, norms, learned vectors
and the exit gate never. Anything else (static activation scales, per-tensor or block scales,
a KV-cache scheme, other formats) is a `CheckpointError` naming what is unsupported.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlt_models.errors import CheckpointError
from rlt_models.families import family_of, parse_config
from rlt_models.fp8 import FP8, quantize_per_channel
from rlt_models.safetensors_files import SINGLE_FILE, iter_checkpoint_tensors

# Runtime parameters (by name suffix) that fp8 quantizes: every family's projections, fused as
# the family fuses them (q/k/v -> qkv_proj, gate/up -> gate_up_proj; HRM-Text's gqkv_proj).
PROJECTION_PARAMETERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LM_HEAD = "lm_head.weight"
SCALE_SUFFIX = "_scale"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Fp8Scheme:
    """An fp8 checkpoint's layout: the stack's projections are fp8; `lm_head` says whether the
    LM head is too."""

    lm_head: bool


def read_scheme(raw_config: dict[str, Any]) -> Fp8Scheme | None:
    """The fp8 scheme of a config.json mapping, None without `quantization_config`."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(
            f"quantization_config: only compressed-tensors fp8 checkpoints load, got {method!r}"
        )
    if quant.get("kv_cache_scheme") is not None:
        raise CheckpointError("quantization_config.kv_cache_scheme is not supported yet")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise CheckpointError("quantization_config: exactly one config group is supported")
    (group,) = groups.values()
    fmt = group.get("format") or quant.get("format")
    if fmt != "float-quantized":
        raise CheckpointError(f"quantization_config: format {fmt!r} (need 'float-quantized')")
    weights = group.get("weights") or {}
    wanted = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    for key, value in wanted.items():
        if weights.get(key) != value:
            raise CheckpointError(
                f"quantization_config weights.{key} = {weights.get(key)!r}; rlt loads fp8 "
                f"weights with {wanted}"
            )
    if weights.get("dynamic"):
        raise CheckpointError("quantization_config: dynamic weight scales are not supported")
    activations = group.get("input_activations")
    if activations is not None and not activations.get("dynamic"):
        raise CheckpointError(
            "quantization_config: static activation scales are not supported (quantize with "
            "dynamic per-token activations, e.g. llm-compressor's FP8_DYNAMIC, or none)"
        )
    if group.get("output_activations") is not None:
        raise CheckpointError("quantization_config: output activation quantization is unsupported")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise CheckpointError(f"quantization_config targets {targets!r} (need ['Linear'])")
    ignore = quant.get("ignore") or []
    return Fp8Scheme(lm_head=LM_HEAD.removesuffix(".weight") not in ignore)


def quantized_names(config, *, lm_head: bool) -> list[str]:
    """Hugging Face names of the weights an fp8 checkpoint of `config`'s family stores in fp8:
    the checkpoint tensors of its projections, and the LM head with `lm_head` (unless the head
    is tied: the checkpoint then stores only the embedding, in its float dtype)."""
    family = family_of(config)
    names = [
        name
        for parameter, sources in family.parameter_sources(config).items()
        if parameter.endswith(PROJECTION_PARAMETERS)
        for name in sources
    ]
    if lm_head and LM_HEAD in family.tensor_shapes(config):
        names.append(LM_HEAD)
    return names


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def quantization_config(*, lm_head: bool) -> dict[str, Any]:
    """The config.json `quantization_config` of a checkpoint this module writes."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
                "output_activations": None,
            }
        },
        "ignore": [] if lm_head else ["lm_head"],
    }


def write_fp8_checkpoint(
    source_dir: str | Path, out_dir: str | Path, *, quantize_lm_head: bool = False
) -> Path:
    """Quantize a bf16/fp32 checkpoint's projections (and the LM head if asked) to fp8 with
    per-channel scales and write it, with its tokenizer files, in the compressed-tensors format.
    Returns the output directory."""
    source, out = Path(source_dir), Path(out_dir)
    raw = json.loads((source / "config.json").read_text())
    if read_scheme(raw) is not None:
        raise CheckpointError(f"{source} is already quantized")
    config = parse_config(raw)
    targets = set(quantized_names(config, lm_head=quantize_lm_head))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint_tensors(source):
        if name in targets:
            data, scale = quantize_per_channel(tensor)
            tensors[name] = data.contiguous()
            tensors[scale_name(name)] = scale[:, None].contiguous()
        else:
            tensors[name] = tensor.contiguous()
    unmatched = sorted(targets - tensors.keys())
    if unmatched:  # e.g. a family whose Hub names differ from its canonical ones
        raise CheckpointError(
            f"{source}: no stored tensor {unmatched[0]!r} to quantize (+{len(unmatched) - 1} "
            "more); write_fp8_checkpoint reads checkpoints stored under the family's own names"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    raw = {**raw, "quantization_config": quantization_config(lm_head=quantize_lm_head)}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def check_quantized_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A quantized weight must be fp8 with its Hugging Face shape."""
    if tensor.dtype != FP8:
        raise CheckpointError(
            f"tensor {name!r} has dtype {tensor.dtype}; this fp8 checkpoint stores it as {FP8}"
        )
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")


def scale_vector(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A `weight_scale` [N, 1] or [N] in a float dtype, as fp32 [N]."""
    if tuple(tensor.shape) not in ((rows, 1), (rows,)):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}; a per-channel scale is "
            f"({rows}, 1) or ({rows},)"
        )
    if not tensor.is_floating_point() or tensor.dtype == FP8:
        raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}; scales are float")
    return tensor.reshape(rows).float()
