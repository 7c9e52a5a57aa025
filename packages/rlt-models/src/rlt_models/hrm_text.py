"""The HRM-Text looped family: two stacks in nested cycles (model-families.md section 1).

Forward: x = embed(ids) * embedding_scale; z_H = x; z_L = z_L_init (a learned vector). One
loop of rlt is one H cycle: L_cycles times z_L = L(z_L + z_H), then z_H = H(z_H + z_L); the
head reads z_H after H_cycles loops. A stack is its layers then a weightless RMSNorm; a layer is
pre-norm (weightless RMSNorm) gated attention + SwiGLU, the attention output multiplied by
sigmoid(gate) element-wise before o_proj; RoPE split-half; multi-head (no GQA).

State: z_H and z_L ([N, 2d], z_H first). KV: one plane per loop (H cycle) holding a slot per
(stack pass, layer): pass l < L_cycles is the l-th L pass, pass L_cycles the H pass, so slot
`pass * layers_per_stack + layer` (transformers' cycle offset within the H cycle). No exit
signal: a token runs its request's loops.

Prompt mask: with `prefix_lm` (the release) the whole prompt is one bidirectional block at
prefill (as vLLM and SGLang serve it; transformers the same given token_type_ids of ones over
the prompt), decode is causal; the engine then prefills every prompt whole. Without it the
prompt is causal.

Checkpoints: `model.{L,H}_module.layers.{i}.attn.gqkv_proj` fused [gate | q | k | v],
`attn.o_proj`, `mlp.gate_up_proj` fused [gate | up], `mlp.down_proj`, `model.embed_tokens`,
`model.z_L_init`, `lm_head` (absent when tied); config.json's `num_hidden_layers` is inflated
to layers_per_stack * H_cycles * (L_cycles + 1): `num_layers_per_stack` is the real count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from rlt_contracts import (
    ExitSignal,
    FamilyDeclaration,
    Feature,
    KVPlan,
    LayerAttention,
    LoopedModelShape,
    PromptMask,
    StagePlan,
)
from torch import nn

from rlt_models import fused_ops
from rlt_models.attention_layer import fused_linear
from rlt_models.config_fields import (
    check_keys,
    eos_ids,
    llama_shape,
    require_fields,
    tied_head,
    torch_dtype_name,
)
from rlt_models.errors import ModelConfigError
from rlt_models.fp8_linear import project
from rlt_models.layers import ModelOps, SwiGLU, apply_rotary, empty_parameter
from rlt_models.loop_cap import ENGINE_FIELD
from rlt_models.looped_model import LoopedModelBase

MODEL_TYPE = "hrm_text"
ARCHITECTURE = "HrmTextForCausalLM"

_IGNORED_KEYS = (
    "attention_dropout",
    "L_bp_cycles",  # training-only gradient routing
    "num_hidden_layers",  # inflated: num_layers_per_stack is the real count
    "initializer_range",  # read for the default embedding_scale
    "rope_parameters",
    "rope_theta",
    "quantization_config",  # read by rlt_models.fp8_checkpoint
)
_NEUTRAL = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
_UNSUPPORTED = ((Feature.SHARED_KV, "its KV keeps a slot per stack pass of each loop"),)
# with prefix_lm (the release) a prompt position's KV depends on every prompt token, later
# ones included, so a cached prefix of one prompt is not the same prefix of another
_PREFIX_LM_UNSUPPORTED = (
    (Feature.PREFIX_CACHING, "a prefix-LM prompt's KV depends on the whole prompt"),
)


@dataclass(frozen=True)
class HrmTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers_per_stack: int
    num_attention_heads: int
    head_dim: int
    H_cycles: int
    L_cycles: int
    max_position_embeddings: int
    embedding_scale: float
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    prefix_lm: bool = True
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (0,)
    torch_dtype: str = "bfloat16"
    # the engine's loop cap in H cycles (loop_cap.py; never in config.json); None: H_cycles
    max_model_loops: int | None = None

    def __post_init__(self) -> None:
        require_fields(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_layers_per_stack",
             "num_attention_heads", "head_dim", "H_cycles", "L_cycles", "max_position_embeddings"),
        )  # fmt: skip
        if self.head_dim % 2:
            raise ModelConfigError("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def passes_per_loop(self) -> int:
        return self.L_cycles + 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HrmTextConfig:
        check_keys(
            raw, cls, model_type=MODEL_TYPE, architecture=ARCHITECTURE, ignored=_IGNORED_KEYS,
            neutral=_NEUTRAL,
        )  # fmt: skip
        h_cycles, l_cycles = raw.get("H_cycles", 2), raw.get("L_cycles", 3)
        # num_hidden_layers is inflated in saved configs (and stale after an H_cycles or
        # L_cycles override): num_layers_per_stack is the real count when present
        per_stack = raw.get("num_layers_per_stack") or raw.get("num_hidden_layers")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError("rope_parameters", f"only default RoPE, got {rope!r}")
        scale = raw.get("embedding_scale")
        if scale is None:
            scale = 1.0 / float(raw.get("initializer_range", 0.02))
        return cls(
            vocab_size=raw.get("vocab_size"),
            hidden_size=raw.get("hidden_size"),
            intermediate_size=raw.get("intermediate_size"),
            num_layers_per_stack=per_stack,
            num_attention_heads=raw.get("num_attention_heads"),
            head_dim=raw.get("head_dim") or 128,
            H_cycles=h_cycles,
            L_cycles=l_cycles,
            max_position_embeddings=raw.get("max_position_embeddings"),
            embedding_scale=float(scale),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
            prefix_lm=bool(raw.get("prefix_lm", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos_ids(raw),
            torch_dtype=torch_dtype_name(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json as transformers writes it (inflated num_hidden_layers)."""
        skipped = ("rope_theta", ENGINE_FIELD)
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skipped}
        out.update(
            architectures=[ARCHITECTURE],
            model_type=MODEL_TYPE,
            num_hidden_layers=self.num_layers_per_stack * self.H_cycles * self.passes_per_loop,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            eos_token_id=list(self.eos_token_id),
            hidden_act="silu",
        )
        return out

    def tied_tensors(self) -> dict[str, str]:
        return tied_head(self.tie_word_embeddings)

    @property
    def model_depth(self) -> int:
        """H cycles the engine is sized for: its cap, by default the checkpoint's H_cycles."""
        return self.max_model_loops or self.H_cycles

    def shape(self) -> LoopedModelShape:
        layers = self.num_layers_per_stack * self.passes_per_loop
        return llama_shape(
            self, layers, self.model_depth, num_kv_heads=self.num_attention_heads,
            state_size=2 * self.hidden_size,
        )  # fmt: skip

    def declaration(self) -> FamilyDeclaration:
        per_stack = self.num_layers_per_stack
        return FamilyDeclaration(
            name="hrm_text",
            architecture=ARCHITECTURE,
            stages=StagePlan(core_layers=2 * per_stack),
            state=("z_H", "z_L"),
            loop_input=f"{self.L_cycles} x z_L = L(z_L + z_H), then z_H = H(z_H + z_L)",
            kv=KVPlan(layers_per_plane=per_stack * self.passes_per_loop),
            exit_signal=ExitSignal.NONE,
            default_loops=self.H_cycles,
            max_loops=self.model_depth,
            loop_limit=None,  # one more H cycle is computable: any cap
            prompt_mask=PromptMask.PREFIX_LM if self.prefix_lm else PromptMask.CAUSAL,
            unsupported=_UNSUPPORTED + (_PREFIX_LM_UNSUPPORTED if self.prefix_lm else ()),
        )


def _stacks(config: HrmTextConfig):
    for stack in ("L", "H"):
        for i in range(config.num_layers_per_stack):
            yield f"model.{stack}_module.layers.{i}", f"{stack}_layers.{i}"


def checkpoint_tensor_shapes(config: HrmTextConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q = config.num_attention_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d),
        "model.z_L_init": (d,),
    }
    for hf, _ in _stacks(config):
        shapes[f"{hf}.attn.gqkv_proj.weight"] = (4 * q, d)
        shapes[f"{hf}.attn.o_proj.weight"] = (d, q)
        shapes[f"{hf}.mlp.gate_up_proj.weight"] = (2 * f, d)
        shapes[f"{hf}.mlp.down_proj.weight"] = (d, f)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def parameter_sources(config: HrmTextConfig) -> dict[str, tuple[str, ...]]:
    sources = {"embed_tokens": ("model.embed_tokens.weight",), "z_L_init": ("model.z_L_init",)}
    for hf, rt in _stacks(config):
        sources[f"{rt}.gqkv_proj"] = (f"{hf}.attn.gqkv_proj.weight",)
        sources[f"{rt}.o_proj"] = (f"{hf}.attn.o_proj.weight",)
        sources[f"{rt}.mlp.gate_up_proj"] = (f"{hf}.mlp.gate_up_proj.weight",)
        sources[f"{rt}.mlp.down_proj"] = (f"{hf}.mlp.down_proj.weight",)
    sources["lm_head"] = (config.tied_tensors().get("lm_head.weight", "lm_head.weight"),)
    return sources


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight: fp32 statistics, the result cast back to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GatedAttentionLayer(nn.Module):
    """x += o(sigmoid(gate) * attn(q, k, v)); x += mlp(norm(x)), from norm(x) = weightless."""

    def __init__(self, config: HrmTextConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        q, d = self.heads * self.head_dim, config.hidden_size
        self.gqkv_proj = empty_parameter(4 * q, d)
        self.o_proj = empty_parameter(d, q)
        self.mlp = SwiGLU(d, config.intermediate_size)
        self.eps = config.rms_norm_eps

    def forward(self, x, cos, sin, attention: LayerAttention, slot: int, ops: ModelOps):
        n, shape = x.shape[0], (x.shape[0], self.heads, self.head_dim)
        gate, q, k, v = project(ops.linear, weightless_rms_norm(x, self.eps), self.gqkv_proj).chunk(
            4, dim=-1
        )
        q = apply_rotary(q.reshape(shape), cos, sin)
        k = apply_rotary(k.reshape(shape), cos, sin)
        out = attention(slot, q, k, v.reshape(shape))
        out = (ops.sigmoid(gate.reshape(shape)) * out).reshape(n, -1)
        x = x + project(ops.linear, out, self.o_proj)
        return x + self.mlp(weightless_rms_norm(x, self.eps), ops)

    def forward_fused(self, x, normed, cos, sin, attention, slot, unit, *, linear, impl, ops):
        """(x, norm(x)) -> (x', norm(x')) on the fused elementwise ops; a weightless norm is
        `fused_ops`' norm with a unit weight (the same numerics: weight * normed with weight 1
        is exact)."""
        n, shape = x.shape[0], (x.shape[0], self.heads, self.head_dim)
        q_size = self.heads * self.head_dim
        gqkv = project(linear, normed, self.gqkv_proj)  # [gate | q | k | v]
        qkv = fused_ops.rotary_qk_(
            gqkv[:, q_size:], cos, sin, self.heads, self.heads, self.head_dim, impl=impl
        )
        q, k, v = (qkv[:, i * q_size : (i + 1) * q_size].view(shape) for i in range(3))
        out = attention(slot, q, k, v)
        out = (ops.sigmoid(gqkv[:, :q_size].view(shape)) * out).reshape(n, -1)
        x, m = fused_ops.add_rms_norm(
            x, project(linear, out, self.o_proj), None, unit, self.eps, impl=impl
        )
        act = fused_ops.silu_mul(
            project(linear, m, self.mlp.gate_up_proj), self.mlp.intermediate_size, impl=impl
        )
        down = project(linear, act, self.mlp.down_proj)
        return fused_ops.add_rms_norm(x, down, None, unit, self.eps, impl=impl)


class HrmTextModel(LoopedModelBase):
    """HRM-Text with the `LoopedLanguageModel` interface; the state is [z_H, z_L]. Its fused
    path (`fused_path`, as Ouro's) runs each stack as the fused pre-norm layers with a unit
    norm weight; the gate's sigmoid and product stay two torch ops."""

    def __init__(self, config: HrmTextConfig) -> None:
        super().__init__(config, config.declaration())
        count = config.num_layers_per_stack
        self.L_layers = nn.ModuleList(GatedAttentionLayer(config) for _ in range(count))
        self.H_layers = nn.ModuleList(GatedAttentionLayer(config) for _ in range(count))
        self.z_L_init = empty_parameter(config.hidden_size)
        # the weightless norms' weight on the fused path (moves and casts with the model)
        self.register_buffer("unit_norm_weight", torch.ones(config.hidden_size), persistent=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[z_H, z_L] = [embed(ids) * embedding_scale, z_L_init] ([N, 2d])."""
        z_high = super().embed(token_ids) * self.config.embedding_scale
        return torch.cat([z_high, self.z_L_init.to(z_high.dtype).expand_as(z_high)], dim=-1)

    def _stack(self, layers, x, cos, sin, attention, first_slot: int, impl) -> torch.Tensor:
        """The stack's layers at KV slots first_slot.., then its weightless norm."""
        eps = self.config.rms_norm_eps
        if impl is None:
            for index, layer in enumerate(layers):
                x = layer(x, cos, sin, attention, first_slot + index, self.ops)
            return weightless_rms_norm(x, eps)
        unit = self.unit_norm_weight
        linear = fused_linear(impl, self.batch_invariant)
        normed = fused_ops.rms_norm(x, unit, eps, impl=impl)
        for index, layer in enumerate(layers):
            x, normed = layer.forward_fused(
                x, normed, cos, sin, attention, first_slot + index, unit,
                linear=linear, impl=impl, ops=self.ops,
            )  # fmt: skip
        return normed  # the last layer's output norm is the stack's norm

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, None]:
        """One H cycle: L_cycles L passes, then the H pass (no exit gate)."""
        config = self.config
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, table=self.batch_invariant)
        z_high, z_low = hidden.split(config.hidden_size, dim=-1)
        per_stack, impl = config.num_layers_per_stack, self.fused_impl(hidden)
        for cycle in range(config.L_cycles):
            z_low = self._stack(
                self.L_layers, z_low + z_high, cos, sin, attention, cycle * per_stack, impl
            )
        z_high = self._stack(
            self.H_layers, z_high + z_low, cos, sin, attention, config.L_cycles * per_stack, impl
        )
        return torch.cat([z_high, z_low], dim=-1), None

    def coda(self, hidden: torch.Tensor, *, needed: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on z_H."""
        return super().coda(hidden[:, : self.config.hidden_size].contiguous(), needed=needed)
