"""Strict loading of a looped model's checkpoint directory (config.json + safetensors +
tokenizer): config.json's `architectures` picks the family (`rlt_models.families`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlt_models.errors import CheckpointError
from rlt_models.families import family_of, read_config
from rlt_models.fp8 import FP8, Fp8Projection, quantize_per_channel
from rlt_models.fp8_checkpoint import (
    PROJECTION_PARAMETERS,
    Fp8Scheme,
    check_quantized_tensor,
    quantized_names,
    read_scheme,
    scale_name,
    scale_vector,
)
from rlt_models.kv_scales import checkpoint_kv_scales, kv_scale_names
from rlt_models.safetensors_files import iter_checkpoint_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, config) -> torch.dtype:
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


QUANTIZATIONS = (None, "fp8")


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    hf_overrides: dict | None = None,
    max_model_loops: int | None = None,
):
    """Build the family's model from a checkpoint directory, checking names and shapes strictly.

    Missing, unexpected or mis-shaped tensors raise `CheckpointError` naming the tensor.
    `quantization` "fp8": the stack's projections (and the LM head with `quantize_lm_head`)
    become fp8 with per-channel scales (`rlt_models.fp8`); a checkpoint that is already fp8
    (compressed-tensors, `rlt_models.fp8_checkpoint`) loads as fp8 whatever is asked.
    `dtype` is the activations' (and every unquantized weight's) dtype. `hf_overrides`: keys
    applied to config.json before the family reads it. `max_model_loops`: the engine's loop
    cap, the model depth `model.shape.num_loops` (None: the family's default; loop_cap.py).
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir, hf_overrides, max_model_loops)
    scheme = read_scheme(json.loads((model_dir / "config.json").read_text()))
    target_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    tensors = dict(iter_checkpoint_tensors(model_dir, device="cpu"))
    return build_model(
        config,
        tensors,
        dtype=target_dtype,
        device=device,
        source=str(model_dir),
        quantization=quantization,
        quantize_lm_head=quantize_lm_head,
        scheme=scheme,
    )


def build_model(
    config,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    source: str = "checkpoint",
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    scheme: Fp8Scheme | None = None,
):
    """The family's model of `config` (a registered family's parsed config) from checkpoint
    tensors keyed by their Hugging Face names (checked strictly;
    q/k/v and gate/up are fused here). `scheme`: the tensors are an fp8 checkpoint's.
    `tensors` is not modified."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantize_lm_head and quantization is None and scheme is None:
        raise ValueError("quantize_lm_head needs quantization='fp8' (or an fp8 checkpoint)")
    family = family_of(config)
    sources = family.parameter_sources(config)
    if family.canonical_name is not None:
        tensors = _canonical_names(family.canonical_name, tensors, source)
    tensors = _drop_tied_copies(config.tied_tensors(), tensors, source)
    tensors = _drop_derived_copies(config, tensors, source)
    stored_fp8 = set(quantized_names(config, lm_head=scheme.lm_head)) if scheme else set()
    kv_scales = kv_scale_names(config) if family.llama_kv_scales else {}
    _check_tensors(family.tensor_shapes(config), tensors, stored_fp8, kv_scales, source)
    with torch.device(device):
        model = family.model(config).to(dtype)
    quantized = set()
    if quantization == "fp8" or scheme is not None:
        quantized = {n for n in sources if n.endswith(PROJECTION_PARAMETERS)}
        if quantize_lm_head or (scheme is not None and scheme.lm_head):
            quantized.add("lm_head")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param_name, source_names in sources.items():
            if param_name in quantized:
                _install_fp8(model, param_name, source_names, tensors, stored_fp8, device)
                continue
            merged = torch.cat([tensors[name] for name in source_names], dim=0)
            params[param_name].copy_(merged.to(device=device, dtype=dtype))
    model.quantization = "fp8" if quantized else None
    model.quantized_lm_head = "lm_head" in quantized
    if family.llama_kv_scales:
        model.checkpoint_kv_scales = checkpoint_kv_scales(config, tensors, source)
    return model.eval()


def _check_tensors(
    expected: dict[str, tuple[int, ...]],
    tensors: dict[str, torch.Tensor],
    stored_fp8: set[str],
    kv_scales: dict,
    source: str,
) -> None:
    scales = {scale_name(name): name for name in stored_fp8}
    for name, tensor in tensors.items():
        if name in scales or name in kv_scales:
            continue  # checked where it is used (its weight's rows; checkpoint_kv_scales)
        if name not in expected:
            if name.endswith("input_scale"):
                raise CheckpointError(
                    f"tensor {name!r} in {source}: static activation scales are not supported"
                )
            raise CheckpointError(
                f"unexpected tensor {name!r} in {source} (not a weight of this model)"
            )
        if name in stored_fp8:
            check_quantized_tensor(name, tensor, expected[name])
            continue
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has non-float dtype {tensor.dtype}")
        if tensor.dtype == FP8:
            raise CheckpointError(
                f"tensor {name!r} is {FP8}, but config.json declares no fp8 quantization for it"
            )
    missing = sorted((set(expected) | set(scales)) - set(tensors))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor(s) {shown}{more} in {source}")


def _canonical_names(rename, tensors: dict[str, torch.Tensor], source: str) -> dict:
    """The tensors under the family's canonical names (two stored names for one is an error)."""
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        canonical = rename(name)
        if canonical in renamed:
            raise CheckpointError(f"{source}: two tensors are stored for {canonical!r}")
        renamed[canonical] = tensor
    return renamed


def _drop_tied_copies(
    ties: dict[str, str], tensors: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """A tied tensor (e.g. the head of a tied model) may be stored or not; stored, it must
    equal the tensor it is tied to, and is then not used."""
    stored = [name for name in ties if name in tensors]
    for name in stored:
        tied_to = ties[name]
        if tied_to in tensors and not torch.equal(tensors[name], tensors[tied_to]):
            raise CheckpointError(
                f"{source}: {name!r} differs from {tied_to!r}, but config.json ties them"
            )
    return {k: v for k, v in tensors.items() if k not in stored}


def _drop_derived_copies(config, tensors: dict[str, torch.Tensor], source: str) -> dict:
    """Tensors a checkpoint may store although config.json defines them (a family config's
    optional `derived_tensors()`, e.g. Huginn's RoPE table `freqs_cis`): a stored one must
    equal the computed one within a few units of its stored dtype's rounding (cos/sin of the
    same fp32 angles differ by an ulp between math libraries), and is then not used."""
    derive = getattr(config, "derived_tensors", None)
    if derive is None:
        return tensors
    derived = derive()
    for name, expected in derived.items():
        stored = tensors.get(name)
        if stored is None:
            continue
        if tuple(stored.shape) != tuple(expected.shape) or not stored.is_floating_point():
            raise CheckpointError(
                f"tensor {name!r} in {source} is {stored.dtype} {tuple(stored.shape)}, expected "
                f"a float tensor of shape {tuple(expected.shape)}"
            )
        error = (stored.float() - expected.float()).abs().max().item()
        if error > 4 * torch.finfo(stored.dtype).eps:
            raise CheckpointError(
                f"tensor {name!r} in {source} differs from what config.json defines (max "
                f"|difference| {error:.3g})"
            )
    return {k: v for k, v in tensors.items() if k not in derived}


def _install_fp8(model, param_name, source_names, tensors, stored_fp8, device) -> None:
    """Replace `param_name` by an `Fp8Projection`: the checkpoint's fp8 rows and scales
    concatenated, or the float rows quantized here (per channel, so the same either way)."""
    if all(name in stored_fp8 for name in source_names):
        data = torch.cat([tensors[name] for name in source_names], dim=0)
        scale = torch.cat(
            [
                scale_vector(scale_name(name), tensors[scale_name(name)], tensors[name].shape[0])
                for name in source_names
            ]
        )
    else:
        merged = torch.cat([tensors[name].float() for name in source_names], dim=0)
        data, scale = quantize_per_channel(merged)
    owner_path, _, attr = param_name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    delattr(owner, attr)
    setattr(owner, attr, Fp8Projection(data.to(device), scale.to(device)))
