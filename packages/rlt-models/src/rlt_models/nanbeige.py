"""The Nanbeige4.2 looped family: Llama layers applied `num_loops` times, the final norm after
every loop (model-families.md section 3).

Forward: h = embed(ids); each loop runs all L pre-norm Llama layers (x += o(attn(norm(x)));
x += down(silu(gate(m)) * up(m)), m = norm(x)), then the model's final RMSNorm (with weight),
whose output is the next loop's input; after the last loop the LM head. With
`skip_loop_final_norm` the loops hand their un-normed output on and only the head's input is
normed. KV: one plane per loop (slot `layer + loop * L`), GQA. There is no exit signal: a token
runs its request's loops.

Checkpoints carry Llama's tensor names. The loop options of the remote code other than
`num_loops` and `skip_loop_final_norm` (`loop_share_kv`, `enable_double_loop_split`,
`loop_middle_layers`, and any other option rlt does not know, such as hyper-connections, depth
attention or n-gram embeddings) are refused at load, by name, unless they hold their disabled
value (false, null, 0 or empty).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from rlt_contracts import (
    ExitSignal,
    FamilyDeclaration,
    KVPlan,
    LayerAttention,
    LoopedModelShape,
    StagePlan,
)
from torch import nn

from rlt_models import fused_ops
from rlt_models.attention_layer import ProjectedAttentionLayer, fused_linear, run_fused_layers
from rlt_models.config_fields import (
    attention_heads,
    check_heads,
    check_keys,
    eos_ids,
    llama_shape,
    require_fields,
    tied_head,
    torch_dtype_name,
)
from rlt_models.fp8_linear import project
from rlt_models.layers import DEFAULT_OPS, ModelOps, RMSNorm
from rlt_models.loop_cap import ENGINE_FIELD
from rlt_models.looped_model import LoopedModelBase
from rlt_models.weights import attention_shapes, mlp_shapes, projection_sources

MODEL_TYPE = "nanbeige"
ARCHITECTURE = "NanbeigeForCausalLM"

# Keys that do not change the computation (training-only settings), besides HF metadata.
_IGNORED_KEYS = (
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",
    "quantization_config",  # read by rlt_models.fp8_checkpoint
)
_NORMS = ("input_layernorm", "post_attention_layernorm")
# Options accepted only at their disabled value (`reject_enabled`), whatever their spelling.
_NEUTRAL = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
    "loop_share_kv": False,
    "enable_double_loop_split": False,
    "loop_middle_layers": None,
}


@dataclass(frozen=True)
class NanbeigeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_loops: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 70_000_000.0
    skip_loop_final_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (0,)
    torch_dtype: str = "bfloat16"
    # the engine's loop cap (loop_cap.py; never in config.json); None: num_loops
    max_model_loops: int | None = None

    def __post_init__(self) -> None:
        require_fields(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_loops",
             "max_position_embeddings"),
        )  # fmt: skip
        check_heads(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NanbeigeConfig:
        check_keys(
            raw, cls, model_type=MODEL_TYPE, architecture=ARCHITECTURE, ignored=_IGNORED_KEYS,
            neutral=_NEUTRAL,
        )  # fmt: skip
        heads, kv_heads, head_dim = attention_heads(raw)
        return cls(
            vocab_size=raw.get("vocab_size"),
            hidden_size=raw.get("hidden_size"),
            intermediate_size=raw.get("intermediate_size"),
            num_hidden_layers=raw.get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_loops=raw.get("num_loops", 1),
            max_position_embeddings=raw.get("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 70_000_000.0)),
            skip_loop_final_norm=bool(raw.get("skip_loop_final_norm", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos_ids(raw),
            torch_dtype=torch_dtype_name(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        """A config.json mapping in the Hub's layout that `from_dict` reads back identically."""
        out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            if f.name != ENGINE_FIELD:
                out[f.name] = getattr(self, f.name)
        out["eos_token_id"] = list(self.eos_token_id)
        out.update(
            hidden_act="silu",
            attention_bias=False,
            loop_share_kv=False,
            enable_double_loop_split=False,
        )
        return out

    def tied_tensors(self) -> dict[str, str]:
        """Tensors a checkpoint may leave out because they equal another (tied head)."""
        return tied_head(self.tie_word_embeddings)

    @property
    def model_depth(self) -> int:
        """The loops the engine is sized for: its cap, by default the checkpoint's count."""
        return self.max_model_loops or self.num_loops

    def shape(self) -> LoopedModelShape:
        return llama_shape(self, self.num_hidden_layers, self.model_depth)

    def declaration(self) -> FamilyDeclaration:
        loop_input = (
            "the previous loop's raw output"
            if self.skip_loop_final_norm
            else "the previous loop's output after the final norm"
        )
        return FamilyDeclaration(
            name=MODEL_TYPE,
            architecture=ARCHITECTURE,
            stages=StagePlan(core_layers=self.num_hidden_layers),
            state=("hidden",),
            loop_input=loop_input,
            kv=KVPlan(layers_per_plane=self.num_hidden_layers),
            exit_signal=ExitSignal.NONE,
            default_loops=self.num_loops,
            max_loops=self.model_depth,
            loop_limit=None,  # more loops of the same layers are computable: any cap
        )


def checkpoint_tensor_shapes(config: NanbeigeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold (Llama names) with its shape."""
    d, v = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update(attention_shapes(config, p) | mlp_shapes(config, p))
        shapes.update({f"{p}.{norm}.weight": (d,) for norm in _NORMS})
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def parameter_sources(config: NanbeigeConfig) -> dict[str, tuple[str, ...]]:
    """Runtime parameter name -> checkpoint tensors concatenated (dim 0) to form it."""
    sources: dict[str, tuple[str, ...]] = {"embed_tokens": ("model.embed_tokens.weight",)}
    for i in range(config.num_hidden_layers):
        hf, rt = f"model.layers.{i}", f"layers.{i}"
        sources.update(projection_sources(hf, rt))
        sources.update({f"{rt}.{norm}.weight": (f"{hf}.{norm}.weight",) for norm in _NORMS})
    sources["norm.weight"] = ("model.norm.weight",)
    sources["lm_head"] = (config.tied_tensors().get("lm_head.weight", "lm_head.weight"),)
    return sources


class LlamaLayer(ProjectedAttentionLayer):
    """Pre-norm layer: x += o(attn(norm1(x))); x += mlp(norm2(x))."""

    def __init__(self, config: NanbeigeConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: LayerAttention, ops: ModelOps = DEFAULT_OPS):
        x = x + self.attend(self.input_layernorm(x), cos, sin, attention, ops.linear, None)
        return x + self.mlp(self.post_attention_layernorm(x), ops)

    def forward_fused(self, x, normed, cos, sin, attention, next_norm_weight, *, impl, invariant):
        """(x, input_layernorm(x)) -> (x', RMSNorm(x'; next_norm_weight)) on the fused ops."""
        linear = fused_linear(impl, invariant)
        eps = self.input_layernorm.eps
        attn = self.attend(normed, cos, sin, attention, linear, impl)
        x, m = fused_ops.add_rms_norm(
            x, attn, None, self.post_attention_layernorm.weight, eps, impl=impl
        )
        gate_up = project(linear, m, self.mlp.gate_up_proj)
        act = fused_ops.silu_mul(gate_up, self.mlp.intermediate_size, impl=impl)
        down = project(linear, act, self.mlp.down_proj)
        return fused_ops.add_rms_norm(x, down, None, next_norm_weight, eps, impl=impl)


class NanbeigeModel(LoopedModelBase):
    """Nanbeige4.2 with the `LoopedLanguageModel` interface (no exit gate)."""

    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__(config, config.declaration())
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, None]:
        """One loop: every layer, then the final norm (unless `skip_loop_final_norm`). The
        family has no gate: the exit probability is always None (its rules never ask)."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, table=self.batch_invariant)
        impl = self.fused_impl(hidden)
        skip_norm = self.config.skip_loop_final_norm
        if impl is None:
            x = hidden
            for layer in self.layers:
                x = layer(x, cos, sin, attention, self.ops)
            return (x if skip_norm else self.norm(x)), None
        x, normed = run_fused_layers(
            self.layers, self.norm, hidden, cos, sin, attention,
            impl=impl, invariant=self.batch_invariant,
        )  # fmt: skip
        return (x if skip_norm else normed), None

    def coda(self, hidden: torch.Tensor, *, needed: torch.Tensor | None = None) -> torch.Tensor:
        """LM head (after the final norm when the loops skipped it)."""
        if self.config.skip_loop_final_norm:
            hidden = self.norm(hidden)
        return super().coda(hidden, needed=needed)
