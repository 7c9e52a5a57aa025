"""Hugging Face tensor names and shapes of the Llama-style layers (Ouro, Nanbeige, Dory) and of
an Ouro checkpoint, and the runtime parameters they form.

The checkpoint stores q/k/v and gate/up separately (`[out_features, in_features]`); the runtime
model fuses them into `qkv_proj` (order q, k, v) and `gate_up_proj` (order gate, up).
"""

from __future__ import annotations

from typing import Any

from rlt_models.config import OuroConfig

_LAYER_NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


def attention_shapes(config: Any, prefix: str, *, gate: bool = False) -> dict[str, tuple]:
    """`prefix`.self_attn's q, k, v (and with `gate` the output gate's) and o projections."""
    d, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    rows = {"q": q, "k": kv, "v": kv} | ({"gate": q} if gate else {})
    shapes = {f"{prefix}.self_attn.{p}_proj.weight": (n, d) for p, n in rows.items()}
    shapes[f"{prefix}.self_attn.o_proj.weight"] = (d, q)
    return shapes


def mlp_shapes(config: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """`prefix`.mlp's gate, up and down projections."""
    d, f = config.hidden_size, config.intermediate_size
    mlp = f"{prefix}.mlp"
    return {
        f"{mlp}.gate_proj.weight": (f, d),
        f"{mlp}.up_proj.weight": (f, d),
        f"{mlp}.down_proj.weight": (d, f),
    }


def projection_sources(hf: str, rt: str, *, fused_qkv: str = "qkv", mlp: str = "mlp."):
    """Runtime projections of a Llama-style layer (`rt`) -> the checkpoint tensors of `hf`
    concatenated to form them: `{fused_qkv}_proj` from the attention's q, k, v (g: its output
    gate) projections, `o_proj`, `{mlp}gate_up_proj` and `{mlp}down_proj`."""
    attention = {"q": "q", "k": "k", "v": "v", "g": "gate"}
    return {
        f"{rt}.{fused_qkv}_proj": tuple(
            f"{hf}.self_attn.{attention[p]}_proj.weight" for p in fused_qkv
        ),
        f"{rt}.o_proj": (f"{hf}.self_attn.o_proj.weight",),
        f"{rt}.{mlp}gate_up_proj": (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
        f"{rt}.{mlp}down_proj": (f"{hf}.mlp.down_proj.weight",),
    }


def checkpoint_tensor_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its exact Hugging Face name, with its shape."""
    d, v = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes.update(attention_shapes(config, prefix) | mlp_shapes(config, prefix))
        shapes.update({f"{prefix}.{norm}.weight": (d,) for norm in _LAYER_NORMS})
    shapes["model.norm.weight"] = (d,)
    shapes["model.early_exit_gate.weight"] = (1, d)
    shapes["model.early_exit_gate.bias"] = (1,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def parameter_sources(config: OuroConfig) -> dict[str, tuple[str, ...]]:
    """Runtime parameter name -> checkpoint tensors concatenated (dim 0) to form it."""
    sources: dict[str, tuple[str, ...]] = {"embed_tokens": ("model.embed_tokens.weight",)}
    for i in range(config.num_hidden_layers):
        hf, rt = f"model.layers.{i}", f"layers.{i}"
        sources.update(projection_sources(hf, rt))
        sources.update({f"{rt}.{norm}.weight": (f"{hf}.{norm}.weight",) for norm in _LAYER_NORMS})
    sources["norm.weight"] = ("model.norm.weight",)
    sources["early_exit_gate_weight"] = ("model.early_exit_gate.weight",)
    sources["early_exit_gate_bias"] = ("model.early_exit_gate.bias",)
    sources["lm_head"] = ("lm_head.weight",)
    return sources
