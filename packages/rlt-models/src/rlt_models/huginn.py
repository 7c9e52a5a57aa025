"""The Huginn-0125 looped family ("Raven", tomg-group-umd/huginn-0125): a prelude, a recurrent
block of 4 layers applied `mean_recurrence` (32) times, a coda (model-families.md section 4;
config.json: `huginn_config.py`).

Forward (the authors' `raven_modeling_minimal.py`):

    e = prelude(wte(x) * embed_scale)              embed_scale = sqrt(n_embd) in the release
    s = s0                                         the initial state (below)
    each step: s = core_block(adapter(cat[s, e]))  adapter: Linear(2d -> d), state first
    logits = head(ln_f(coda(ln_f(s))))             the same ln_f twice; the head tied to wte

Every block is a "sandwich": x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x))),
RMSNorm with fp32 statistics cast back, then times the weight. Attention: fused Wqkv [q; k; v],
q += qk_bias[0] and k += qk_bias[1] BEFORE RoPE, RoPE on ADJACENT pairs (x[2j], x[2j + 1]) at
frequency rope_base^(-2j / head_dim), rotated in fp32 and cast back; multi-head, no GQA. MLP:
fc -> (gate, up) halves, proj(silu(gate) * up). No biases besides qk_bias.

State: [s, e] ([N, 2d]); `embed` (the prelude) returns [s0, e], `recurrent_step` one step,
`finish` the coda's blocks on ln_f(s), `coda` ln_f and the head. KV: the core layers keep one
plane per step (a query at step k reads step k's keys of earlier positions: the authors'
"full" cache); the prelude's and coda's layers one slot each on the stage plane
(`KVPlan.stage_layers`). Exit signal: each step's latent change ||s_k - s_{k-1}|| / ||s_k||
in fp32 (`ExitSignal.LATENT_CHANGE`, the authors' `latent-diff`), read by the scheduler's
`latent_diff` rules; a request without a threshold runs its `max_loops` steps (by default
`mean_recurrence`, at most the engine's cap, by default twice that).

Fused path (`fused_path`, on by default on CUDA with Triton): every block's projections run the
measured small-batch kernel (`attention_layer.fused_linear`: weight streaming at a few rows;
cuBLAS where it measures faster) and its norms and SwiGLU product the `fused_ops` kernels (one
kernel each, the eager numerics; the "torch" impl is bit-identical to eager). A decode tick
passes the prelude and the coda `needed` (does any row run the stage in this tick?), so at a few
rows their weights are read in a token's first and last step only.

Initial state: the release's `state_init` "like-init" draws s0 from a truncated normal (std
sqrt(2 / (5 n_embd)), cut at +-3 std, times sqrt(n_embd)), as the authors' code does on every
call. rlt draws it per token from the uniforms the runner passes (`embed(..., uniforms=...)`:
the token's request seed and position, a stream apart from token sampling's), by the inverse
normal CDF restricted to [-3, 3], so a request's output never depends on its batch, on
preemption or on where it runs. Without uniforms (the engine's `initial_state="zero"`) and for
a checkpoint whose `state_init` is "zero", s0 is zero (the authors' `init_scale=0`).

Checkpoints (the Hub's names, as the authors' class stores them): `transformer.wte.weight`,
`transformer.adapter.weight` [d, 2d], `transformer.ln_f.weight`, for each block of
`transformer.{prelude,core_block,coda}.{i}`: `attn.Wqkv.weight` [3d, d], `attn.proj.weight`,
`attn.qk_bias` [2, 1, heads, head_dim] (with `qk_bias`), `mlp.fc.weight` [2f, d] (gate then
up), `mlp.proj.weight`, `norm_1..norm_4.weight`; `lm_head.weight` when the head is not tied
(tied: it may be stored, equal to the embedding, as on the Hub, or not). The RoPE table
`freqs_cis` [1, block_size, 1, head_dim / 2, 2] (cos, sin), a persistent buffer of the
authors' model, may be stored: it must then equal the table computed here (`derived_tensors`).
"""

from __future__ import annotations

import math

import torch
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import fused_ops
from rlt_models.attention_layer import fused_linear
from rlt_models.fp8_linear import project
from rlt_models.huginn_config import STAGES, HuginnConfig, rope_table
from rlt_models.layers import ModelOps, RMSNorm, empty_parameter
from rlt_models.looped_model import LoopedModelBase


class PairRotary:
    """The pair-wise RoPE table (fp32 cos/sin of every position below block_size), computed
    once per device and gathered by position: a row's values never depend on its batch."""

    def __init__(self, head_dim: int, base: float, positions: int) -> None:
        self.head_dim, self.base, self.positions = head_dim, base, positions
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim / 2] fp32 (broadcast over heads)."""
        table = self._tables.get(positions.device)
        if table is None:
            table = rope_table(self.head_dim, self.base, self.positions, positions.device)
            self._tables[positions.device] = table
        cos, sin = table
        return cos[positions][:, None], sin[positions][:, None]


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] with each pair (x[2j], x[2j + 1]) rotated by angle j, in fp32 (the
    authors' `apply_rotary_emb_complex_like`), cast back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class SandwichBlock(nn.Module):
    """One block (module doc); `slot` is its KV slot on its plane."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        d, f = config.n_embd, config.intermediate_size
        self.heads, self.head_dim, self.intermediate_size = config.n_heads, config.head_dim, f
        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = (
            RMSNorm(d, config.norm_eps) for _ in range(4)
        )
        self.qkv_proj = empty_parameter(3 * d, d)
        self.qk_bias = empty_parameter(2, 1, self.heads, self.head_dim) if config.qk_bias else None
        self.o_proj = empty_parameter(d, d)
        self.gate_up_proj = empty_parameter(2 * f, d)
        self.down_proj = empty_parameter(d, f)

    def forward(
        self, x, cos, sin, attention: LayerAttention, slot: int, ops: ModelOps, impl, needed=None
    ):
        """`ops`: `HuginnModel.block_ops`; `impl`: None (eager) or the `fused_ops` impl of the
        norms and the SwiGLU product (the same numerics in one kernel each); `needed` (device
        int32 [1], or None): where 0 no row keeps this block's result, and a small-batch Triton
        projection reads no weight (the `coda(needed=...)` contract)."""
        n, linear = x.shape[0], ops.linear
        qkv = project(linear, _norm(self.norm_1, x, impl), self.qkv_proj, needed)
        q, k, v = qkv.view(n, 3, self.heads, -1).unbind(1)
        if self.qk_bias is not None:  # before RoPE
            q, k = q + self.qk_bias[0, 0], k + self.qk_bias[1, 0]
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = attention(slot, q, k, v).reshape(n, -1)
        x = _add_norm(self.norm_2, x, project(linear, out, self.o_proj, needed), impl)
        gate_up = project(linear, _norm(self.norm_3, x, impl), self.gate_up_proj, needed)
        if impl is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = ops.silu(gate) * up
        else:
            act = fused_ops.silu_mul(gate_up, self.intermediate_size, impl=impl)
        return _add_norm(self.norm_4, x, project(linear, act, self.down_proj, needed), impl)


def _norm(norm: RMSNorm, x: torch.Tensor, impl: str | None) -> torch.Tensor:
    return norm(x) if impl is None else fused_ops.rms_norm(x, norm.weight, norm.eps, impl=impl)


def _add_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor, impl: str | None):
    """norm(x + delta): the sandwich's residual, normed."""
    if impl is None:
        return norm(x + delta)
    return fused_ops.add_rms_norm(x, delta, None, norm.weight, norm.eps, impl=impl)[1]


class HuginnModel(LoopedModelBase):
    """Huginn with the `LoopedLanguageModel` interface: `embed` runs the prelude and `finish`
    the coda's blocks, both on the stage plane (`positions` and `attention` required)."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__(config, config.declaration())
        d = config.n_embd
        self.adapter = empty_parameter(d, 2 * d)
        self.prelude = nn.ModuleList(
            SandwichBlock(config) for _ in range(config.n_layers_in_prelude)
        )
        self.core_block = nn.ModuleList(
            SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)
        )
        self.coda_blocks = nn.ModuleList(
            SandwichBlock(config) for _ in range(config.n_layers_in_coda)
        )
        self.ln_f = RMSNorm(d, config.norm_eps)
        self.pair_rotary = PairRotary(config.head_dim, config.rope_base, config.block_size)

    def block_ops(self, x: torch.Tensor) -> tuple[ModelOps, str | None]:
        """The ops of every block and the fused path's impl (None: eager). On the fused path
        the linear is `attention_layer.fused_linear`'s: on CUDA with Triton the measured
        small-batch kernel (weight streaming at a few rows)."""
        impl = self.fused_impl(x)
        if impl is None:
            return self.ops, None
        return self.ops._replace(linear=fused_linear(impl, self.batch_invariant)), impl

    def _run(self, blocks, x, positions, attention, first_slot: int, needed=None) -> torch.Tensor:
        if attention is None or positions is None:
            raise ValueError("Huginn's prelude and coda attend: pass positions and attention")
        cos, sin = self.pair_rotary.cos_sin(positions)
        ops, impl = self.block_ops(x)
        for index, block in enumerate(blocks):
            x = block(x, cos, sin, attention, first_slot + index, ops, impl, needed)
        return x

    def embed(
        self, token_ids, positions=None, attention=None, uniforms=None, *, needed=None
    ) -> torch.Tensor:
        """The prelude (stage slots 0..): [s0, e] of the scaled embeddings; s0 drawn from
        `uniforms` [N, n_embd] (module doc), zero without them. `needed`: see `forward`."""
        x = super().embed(token_ids) * self.config.scale
        e = self._run(self.prelude, x, positions, attention, 0, needed)
        if uniforms is None or self.config.state_init == "zero":
            return torch.cat([torch.zeros_like(e), e], dim=-1)
        return torch.cat([truncated_normal_state(uniforms, self.config.n_embd).to(e.dtype), e], -1)

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: s = core_block(adapter(cat[s, e])); `hidden` is cat[s, e] already. With
        `compute_gate`, also the step's latent change ||s_k - s_{k-1}|| / ||s_k|| [N] in fp32
        (ExitSignal.LATENT_CHANGE; the authors' `latent-diff` criterion)."""
        d = self.config.n_embd
        e = hidden[:, d:]
        ops, impl = self.block_ops(hidden)
        x = project(ops.linear, hidden, self.adapter)
        cos, sin = self.pair_rotary.cos_sin(positions)
        for index, block in enumerate(self.core_block):
            x = block(x, cos, sin, attention, index, ops, impl)
        change = None
        if compute_gate:
            now = x.float()
            change = (now - hidden[:, :d].float()).norm(dim=-1) / now.norm(dim=-1)
        return torch.cat([x, e], dim=-1), change

    def finish(self, hidden, positions, attention, *, needed=None) -> torch.Tensor:
        """The coda's blocks on ln_f(s) (stage slots after the prelude's)."""
        d = self.config.n_embd
        x = self.ln_f(hidden[:, :d])
        first_slot = self.config.n_layers_in_prelude
        x = self._run(self.coda_blocks, x, positions, attention, first_slot, needed)
        return torch.cat([x, hidden[:, d:]], dim=-1)

    def coda(self, hidden: torch.Tensor, *, needed: torch.Tensor | None = None) -> torch.Tensor:
        """ln_f (its second use) and the head: logits [N, V] in the model dtype."""
        x = self.ln_f(hidden[:, : self.config.n_embd].contiguous())
        return super().coda(x, needed=needed)


TRUNCATION = 3.0  # the initial state's normal is cut at +-3 std
_EDGE = 0.5 * math.erfc(TRUNCATION / math.sqrt(2.0))  # Phi(-3)


def truncated_normal_state(uniforms: torch.Tensor, n_embd: int) -> torch.Tensor:
    """The like-init state of uniforms in (0, 1), fp32: Phi^-1 of a uniform on [Phi(-3), Phi(3)]
    times std sqrt(2 / (5 n_embd)), times sqrt(n_embd)."""
    p = _EDGE + uniforms.float() * (1.0 - 2.0 * _EDGE)
    standard = math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)
    return standard.clamp_(-TRUNCATION, TRUNCATION) * (
        math.sqrt(2.0 / (5 * n_embd)) * math.sqrt(n_embd)
    )


def _block_tensor_shapes(config: HuginnConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    d, f = config.n_embd, config.intermediate_size
    shapes = {f"{prefix}.norm_{i}.weight": (d,) for i in range(1, 5)}
    shapes[f"{prefix}.attn.Wqkv.weight"] = (3 * d, d)
    if config.qk_bias:
        shapes[f"{prefix}.attn.qk_bias"] = (2, 1, config.n_heads, config.head_dim)
    shapes[f"{prefix}.attn.proj.weight"] = (d, d)
    shapes[f"{prefix}.mlp.fc.weight"] = (2 * f, d)
    shapes[f"{prefix}.mlp.proj.weight"] = (d, f)
    return shapes


def _blocks(config: HuginnConfig):
    """(stage, index) of every block, prelude first."""
    counts = (
        config.n_layers_in_prelude,
        config.n_layers_in_recurrent_block,
        config.n_layers_in_coda,
    )
    for stage, count in zip(STAGES, counts, strict=True):
        for i in range(count):
            yield stage, i


def checkpoint_tensor_shapes(config: HuginnConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold (the Hub's names) with its shape."""
    d, v = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (v, d),
        "transformer.adapter.weight": (d, 2 * d),
    }
    for stage, i in _blocks(config):
        shapes.update(_block_tensor_shapes(config, f"transformer.{stage}.{i}"))
    shapes["transformer.ln_f.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def parameter_sources(config: HuginnConfig) -> dict[str, tuple[str, ...]]:
    """Runtime parameter name -> checkpoint tensors concatenated (dim 0) to form it."""
    sources: dict[str, tuple[str, ...]] = {
        "embed_tokens": ("transformer.wte.weight",),
        "adapter": ("transformer.adapter.weight",),
    }
    runtime_stage = {"prelude": "prelude", "core_block": "core_block", "coda": "coda_blocks"}
    for stage, i in _blocks(config):
        hf, rt = f"transformer.{stage}.{i}", f"{runtime_stage[stage]}.{i}"
        sources[f"{rt}.qkv_proj"] = (f"{hf}.attn.Wqkv.weight",)
        sources[f"{rt}.o_proj"] = (f"{hf}.attn.proj.weight",)
        sources[f"{rt}.gate_up_proj"] = (f"{hf}.mlp.fc.weight",)
        sources[f"{rt}.down_proj"] = (f"{hf}.mlp.proj.weight",)
        if config.qk_bias:
            sources[f"{rt}.qk_bias"] = (f"{hf}.attn.qk_bias",)
        for n in range(1, 5):
            sources[f"{rt}.norm_{n}.weight"] = (f"{hf}.norm_{n}.weight",)
    sources["ln_f.weight"] = ("transformer.ln_f.weight",)
    sources["lm_head"] = (config.tied_tensors().get("lm_head.weight", "lm_head.weight"),)
    return sources
