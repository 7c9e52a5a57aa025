"""Hugging Face tensor names and shapes of an Ouro checkpoint, and their runtime parameters.

The checkpoint stores q/k/v and gate/up separately (`[out_features, in_features]`); the runtime
model fuses them into `qkv_proj` (order q, k, v) and `gate_up_proj` (order gate, up).
"""

from __future__ import annotations

from rlt_models.config import OuroConfig

_LAYER_NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


def checkpoint_tensor_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its exact Hugging Face name, with its shape."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q, d)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv, d)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv, d)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (d, q)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (f, d)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (f, d)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (d, f)
        for norm in _LAYER_NORMS:
            shapes[f"{prefix}.{norm}.weight"] = (d,)
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
        sources[f"{rt}.qkv_proj"] = tuple(
            f"{hf}.self_attn.{p}_proj.weight" for p in ("q", "k", "v")
        )
        sources[f"{rt}.o_proj"] = (f"{hf}.self_attn.o_proj.weight",)
        sources[f"{rt}.mlp.gate_up_proj"] = (
            f"{hf}.mlp.gate_proj.weight",
            f"{hf}.mlp.up_proj.weight",
        )
        sources[f"{rt}.mlp.down_proj"] = (f"{hf}.mlp.down_proj.weight",)
        for norm in _LAYER_NORMS:
            sources[f"{rt}.{norm}.weight"] = (f"{hf}.{norm}.weight",)
    sources["norm.weight"] = ("model.norm.weight",)
    sources["early_exit_gate_weight"] = ("model.early_exit_gate.weight",)
    sources["early_exit_gate_bias"] = ("model.early_exit_gate.bias",)
    sources["lm_head"] = ("lm_head.weight",)
    return sources
