"""Dory's config.json (`DoryForCausalLM`, model_type `dory`), its declaration and checkpoint layout
(the model: dory.py; model-families.md section 2).

A Hub config counts a layer's attention and MLP blocks as two entries: `layer_types` alternates
with "mlp" and `num_hidden_layers`, `n_input_layers`, `n_recurrent_layers`, `n_output_layers`
are doubled; `from_dict` halves them and `to_dict` writes them back so. RoPE theta per layer type
(`rope_parameters`: sliding 1e4, full 1e7). `recurrent_kv_cache_mode` "per_loop" (one plane per
loop) or "last_loop" (one plane every loop overwrites). The engine's loop cap defaults to twice
`n_recurrent_loops` (elastic depth).

Checkpoints: transformers' names (`model.layers.{i}.self_attn.{q,k,v,o,gate}_proj`, `sqk`,
`s_gate`, `mlp.{gate,up,down}_proj`, `suv_gate`, `suv_up`, `lambda_1`, `lambda_2`,
`model.embed_tokens`, `lm_head.weight`, `lm_head.logit_scale`) or the Hub's (`backbone.*`, each
layer stored as an attention block `layers.{2i}.mixer` and an MLP block `layers.{2i+1}.mixer`,
`attn_alpha` / `mlp_alpha`, `g_proj`; `hub_tensor_name` maps them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from rlt_contracts import (
    ExitSignal,
    FamilyDeclaration,
    Feature,
    KVPlan,
    LoopedModelShape,
    StagePlan,
)

from rlt_models.config_fields import (
    check_heads,
    check_keys,
    eos_ids,
    llama_shape,
    require_fields,
    tied_head,
    torch_dtype_name,
)
from rlt_models.errors import ModelConfigError
from rlt_models.loop_cap import ENGINE_FIELD
from rlt_models.weights import attention_shapes, mlp_shapes, projection_sources

MODEL_TYPE = "dory"
ARCHITECTURE = "DoryForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
KV_MODES = ("per_loop", "last_loop")

_IGNORED_KEYS = (
    "attention_dropout",
    "num_hidden_layers",
    "layer_types",
    "rope_parameters",
    "n_input_layers",
    "n_recurrent_layers",
    "n_output_layers",
)
_NEUTRAL = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
_UNSUPPORTED = (
    (Feature.SPECULATIVE_DECODING, "a draft's positions would need the prelude's and coda's KV"),
    (Feature.EXIT_DEPTH_SCORING, "it has no exit signal"),
    (Feature.FP8_WEIGHTS, "its nGPT projections are not quantized by rlt yet"),
    (Feature.FP8_KV, "not verified for this family yet"),
)


@dataclass(frozen=True)
class DoryConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_input_layers: int
    n_recurrent_layers: int
    n_output_layers: int
    n_recurrent_loops: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int = 1024
    rope_theta_sliding: float = 10_000.0
    rope_theta_full: float = 10_000_000.0
    initializer_range: float = 0.0177
    ngpt_alpha_init: float = 0.05
    recurrent_kv_cache_mode: str = "per_loop"
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (0,)
    torch_dtype: str = "bfloat16"
    max_model_loops: int | None = None  # the engine's cap (loop_cap.py), never in config.json

    def __post_init__(self) -> None:
        require_fields(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "n_recurrent_layers", "n_recurrent_loops",
             "max_position_embeddings", "sliding_window"),
        )  # fmt: skip
        require_fields(self, ("n_input_layers", "n_output_layers"), minimum=0)
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                "layer_types",
                f"{len(self.layer_types)} entries for {self.num_layers} layers "
                "(n_input_layers + n_recurrent_layers + n_output_layers)",
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ModelConfigError("layer_types", f"unknown layer type(s) {unknown}")
        check_heads(self)
        if self.recurrent_kv_cache_mode not in KV_MODES:
            raise ModelConfigError(
                "recurrent_kv_cache_mode",
                f"must be one of {KV_MODES}, got {self.recurrent_kv_cache_mode!r}",
            )

    @property
    def num_layers(self) -> int:
        return self.n_input_layers + self.n_recurrent_layers + self.n_output_layers

    @property
    def rope_theta(self) -> float:  # LoopedModelBase's rotary: the sliding layers'
        return self.rope_theta_sliding

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DoryConfig:
        check_keys(
            raw, cls, model_type=MODEL_TYPE, architecture=ARCHITECTURE, ignored=_IGNORED_KEYS,
            neutral=_NEUTRAL,
        )  # fmt: skip
        counts = {
            key: raw.get(key, default)
            for key, default in (
                ("num_hidden_layers", 36),
                ("n_input_layers", 8),
                ("n_recurrent_layers", None),
                ("n_output_layers", 8),
            )
        }
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list) and "mlp" in layer_types:
            # the Hub counts a layer's attention and MLP blocks as two entries
            layer_types = layer_types[::2]
            counts = {k: v // 2 if isinstance(v, int) else v for k, v in counts.items()}
        total = counts["num_hidden_layers"]
        recurrent = counts["n_recurrent_layers"]
        if recurrent is None and isinstance(total, int):
            recurrent = total - counts["n_input_layers"] - counts["n_output_layers"]
        if layer_types is None and isinstance(total, int):
            layer_types = [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(total)]
        if not isinstance(layer_types, list):
            raise ModelConfigError("layer_types", f"must be a list, got {layer_types!r}")
        thetas = _rope_thetas(raw.get("rope_parameters"))
        heads = raw.get("num_attention_heads", 16)
        return cls(
            vocab_size=raw.get("vocab_size", 131072),
            hidden_size=raw.get("hidden_size", 2560),
            intermediate_size=raw.get("intermediate_size", 7168),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim", 256),
            n_input_layers=counts["n_input_layers"],
            n_recurrent_layers=recurrent,
            n_output_layers=counts["n_output_layers"],
            n_recurrent_loops=raw.get("n_recurrent_loops", 2),
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            layer_types=tuple(layer_types),
            sliding_window=raw.get("sliding_window", 1024),
            rope_theta_sliding=thetas[SLIDING],
            rope_theta_full=thetas[FULL],
            initializer_range=float(raw.get("initializer_range", 0.0177)),
            ngpt_alpha_init=float(raw.get("ngpt_alpha_init", 0.05)),
            recurrent_kv_cache_mode=raw.get("recurrent_kv_cache_mode", "per_loop"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos_ids(raw),
            torch_dtype=torch_dtype_name(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json in the Hub's layout (two entries per layer) that `from_dict` reads."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            if not f.name.startswith("rope_theta") and f.name != ENGINE_FIELD:
                out[f.name] = getattr(self, f.name)
        out.update(
            layer_types=[block for kind in self.layer_types for block in (kind, "mlp")],
            num_hidden_layers=2 * self.num_layers,
            n_input_layers=2 * self.n_input_layers,
            n_recurrent_layers=2 * self.n_recurrent_layers,
            n_output_layers=2 * self.n_output_layers,
            rope_parameters={
                kind: {"rope_type": "default", "rope_theta": theta}
                for kind, theta in (
                    (SLIDING, self.rope_theta_sliding),
                    (FULL, self.rope_theta_full),
                )
            },
            eos_token_id=list(self.eos_token_id),
            hidden_act="silu",
        )
        return out

    def tied_tensors(self) -> dict[str, str]:
        return tied_head(self.tie_word_embeddings)

    @property
    def stage_layers(self) -> int:
        return self.n_input_layers + self.n_output_layers

    @property
    def loop_cap(self) -> int:
        """The engine's cap on a request's loops: by default twice the checkpoint's (elastic)."""
        return self.max_model_loops or 2 * self.n_recurrent_loops

    def shape(self) -> LoopedModelShape:
        # one block holds a plane's slots: the recurrent layers', or the stage plane's
        layers = max(self.n_recurrent_layers, self.stage_layers)
        return llama_shape(self, layers, self.loop_cap, state_size=2 * self.hidden_size)

    def declaration(self) -> FamilyDeclaration:
        per_loop = self.recurrent_kv_cache_mode == "per_loop"
        unsupported = _UNSUPPORTED
        if not per_loop:
            unsupported += (
                (Feature.PREFIX_CACHING, "last_loop KV: a prompt's earlier loops see the whole "
                 "prompt's own keys, so its KV depends on where the prompt starts"),
            )  # fmt: skip
        else:
            unsupported += (
                (Feature.SHARED_KV, "its recurrent KV mode comes from the checkpoint: "
                 "hf_overrides={'recurrent_kv_cache_mode': 'last_loop'} shares one plane"),
            )  # fmt: skip
        return FamilyDeclaration(
            name=MODEL_TYPE,
            architecture=ARCHITECTURE,
            stages=StagePlan(
                core_layers=self.n_recurrent_layers,
                prelude_layers=self.n_input_layers,
                coda_layers=self.n_output_layers,
            ),
            state=("hidden", "prelude_output"),
            loop_input="unit(h) + unit(prelude output)",
            kv=KVPlan(
                layers_per_plane=max(self.n_recurrent_layers, self.stage_layers),
                per_loop=per_loop,
                stage_layers=self.stage_layers,
                sliding_window=SLIDING in self.layer_types,
            ),
            exit_signal=ExitSignal.NONE,
            default_loops=self.n_recurrent_loops,
            max_loops=self.loop_cap,
            loop_limit=None,
            unsupported=unsupported,
        )


def _rope_thetas(parameters: Any) -> dict[str, float]:
    thetas = {SLIDING: 10_000.0, FULL: 10_000_000.0}
    if parameters is None:
        return thetas
    if not isinstance(parameters, dict):
        raise ModelConfigError("rope_parameters", f"must be a mapping, got {parameters!r}")
    for kind, params in parameters.items():
        if kind not in thetas or not isinstance(params, dict):
            raise ModelConfigError("rope_parameters", f"unexpected entry {kind!r}: {params!r}")
        if params.get("rope_type", "default") != "default":
            raise ModelConfigError("rope_parameters", f"only default RoPE, got {params!r}")
        thetas[kind] = float(params.get("rope_theta", thetas[kind]))
    return thetas


_HUB_BLOCK = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")


def hub_tensor_name(name: str) -> str:
    """A Hub checkpoint's tensor name in transformers' layout (names already in it pass)."""
    match = _HUB_BLOCK.search(name)
    if match is not None:
        index, block = int(match[1]), match[2]
        part = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(
            block, ("self_attn", "mlp")[index % 2]
        )
        name = f"{name[: match.start()]}layers.{index // 2}.{part}{name[match.end() :]}"
    name = name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")
    name = re.sub(r"^backbone\.", "model.", name)
    return name.replace(".embeddings.", ".embed_tokens.")


def checkpoint_tensor_shapes(config: DoryConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q = config.num_attention_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        shapes.update(attention_shapes(config, p, gate=True))
        shapes.update({f"{p}.self_attn.sqk": (q,), f"{p}.self_attn.s_gate": (q,)})
        shapes.update(mlp_shapes(config, p))
        shapes.update({f"{p}.mlp.suv_gate": (f,), f"{p}.mlp.suv_up": (f,)})
        shapes.update({f"{p}.lambda_1": (d,), f"{p}.lambda_2": (d,)})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    shapes["lm_head.logit_scale"] = (v,)
    return shapes


def parameter_sources(config: DoryConfig) -> dict[str, tuple[str, ...]]:
    sources: dict[str, tuple[str, ...]] = {"embed_tokens": ("model.embed_tokens.weight",)}
    for i in range(config.num_layers):
        hf, rt = f"model.layers.{i}", f"layers.{i}"
        sources.update(projection_sources(hf, rt, fused_qkv="qkvg", mlp=""))
        for name in ("self_attn.sqk", "self_attn.s_gate", "mlp.suv_gate", "mlp.suv_up"):
            sources[f"{rt}.{name.split('.')[1]}"] = (f"{hf}.{name}",)
        sources[f"{rt}.lambda_1"] = (f"{hf}.lambda_1",)
        sources[f"{rt}.lambda_2"] = (f"{hf}.lambda_2",)
    sources["lm_head"] = (config.tied_tensors().get("lm_head.weight", "lm_head.weight"),)
    sources["logit_scale"] = ("lm_head.logit_scale",)
    return sources
