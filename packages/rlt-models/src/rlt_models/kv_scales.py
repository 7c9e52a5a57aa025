"""Per-layer scales of an fp8 KV cache: read from the checkpoint, or calibrated at load on the
bundled sample text (README.md's FP8 section, "fp8 KV scales": the names and the calibration).

One key and one value scale per layer, shared by every loop plane: a layer's weights are shared
across loops, and one scale lets LAST_EXITED finalization, prefix caching and PD transfers copy
planes as raw bytes. A family with stage layers (`KVPlan.stage_layers`: Huginn, Dory) also
calibrates through its prelude (`embed`) and coda (`finish`): its stage plane's slot l shares
scale l with the loop planes' slot l, so s_l covers both. s_l = the power of two at or above
HEADROOM * max / 448: a power of two makes dequantization exact and the result independent of
last-bit differences between devices (a PD pair calibrates to the same scales, and the
handshake compares them); HEADROOM = 2 leaves room for values the calibration text did not
produce at the cost of one exponent step of the 15 below the largest (e4m3 keeps 3 mantissa
bits at every normal exponent, so precision is unchanged).
"""

from __future__ import annotations

import math

import torch

from rlt_models.config import OuroConfig
from rlt_models.dense_attention import DenseCausalAttention, DenseKVCache
from rlt_models.errors import CheckpointError

FP8_MAX = 448.0
HEADROOM = 2.0
# calibration tokens at most (one dense forward of this many positions per loop)
MAX_CALIBRATION_TOKENS = 256

KVScaleTuple = tuple[tuple[float, ...], tuple[float, ...]]


def kv_scale_names(config: OuroConfig) -> dict[str, tuple[str, int]]:
    """Checkpoint name -> ("key" | "value", layer) of every per-layer KV scale."""
    names = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        names[prefix + "k_scale"] = ("key", layer)
        names[prefix + "v_scale"] = ("value", layer)
    return names


def checkpoint_kv_scales(
    config: OuroConfig, tensors: dict[str, torch.Tensor], source: str = "checkpoint"
) -> KVScaleTuple | None:
    """The checkpoint's KV scales (every layer's k_scale and v_scale), or None without any;
    a partial set or a scale that is not one positive finite number raises CheckpointError."""
    names = kv_scale_names(config)
    present = [name for name in names if name in tensors]
    if not present:
        return None
    if len(present) != len(names):
        missing = sorted(set(names) - set(present))[:3]
        raise CheckpointError(f"{source}: KV scales for some layers only (missing {missing})")
    scales = {"key": [0.0] * config.num_hidden_layers, "value": [0.0] * config.num_hidden_layers}
    for name, (which, layer) in names.items():
        tensor = tensors[name]
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} must hold one float, got {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"tensor {name!r} must be a positive finite scale, got {value}")
        scales[which][layer] = value
    return tuple(scales["key"]), tuple(scales["value"])


class _RecordingAttention(DenseCausalAttention):
    """Dense attention that keeps max |k| and max |v| per layer."""

    def __init__(self, cache: DenseKVCache, key_max: torch.Tensor, value_max: torch.Tensor):
        super().__init__(cache)
        self.key_max, self.value_max = key_max, value_max

    def __call__(self, layer_index, query, key, value, **options):
        self.key_max[layer_index] = torch.maximum(self.key_max[layer_index], key.abs().max())
        self.value_max[layer_index] = torch.maximum(self.value_max[layer_index], value.abs().max())
        return super().__call__(layer_index, query, key, value, **options)


def power_of_two_scale(largest: float) -> float:
    """The power of two at or above HEADROOM * largest / 448 (2**-20 for an all-zero layer)."""
    if largest <= 0:
        return 2.0**-20
    return 2.0 ** math.ceil(math.log2(HEADROOM * largest / FP8_MAX))


@torch.no_grad()
def calibrate_kv_scales(model, token_ids: list[int]) -> KVScaleTuple:
    """Per-layer key and value scales from one full-depth pass over `token_ids` (module doc)."""
    ids = list(token_ids)[:MAX_CALIBRATION_TOKENS]
    if not ids:
        raise ValueError("KV scale calibration needs at least one token")
    shape = model.shape
    device = model.device
    key_max = torch.zeros(shape.num_layers, device=device)
    value_max = torch.zeros(shape.num_layers, device=device)
    tokens = torch.tensor(ids, device=device)
    positions = torch.arange(len(ids), device=device)
    stage = None  # the prelude's and coda's KV (their slots of the stage plane)
    if model.family.kv.stage_layers:
        stage = _RecordingAttention(DenseKVCache(shape.num_layers), key_max, value_max)
        hidden = model.embed(tokens, positions, stage)
    else:
        hidden = model.embed(tokens)
    for _ in range(shape.num_loops):  # one dense cache per loop depth, as Hugging Face's
        attention = _RecordingAttention(DenseKVCache(shape.num_layers), key_max, value_max)
        hidden, _ = model.recurrent_step(hidden, positions, attention, compute_gate=False)
    if stage is not None:
        model.finish(hidden, positions, stage)
    keys = tuple(power_of_two_scale(v) for v in key_max.tolist())
    values = tuple(power_of_two_scale(v) for v in value_max.tolist())
    return keys, values
