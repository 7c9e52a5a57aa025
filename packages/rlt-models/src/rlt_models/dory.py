"""The Dory looped family (NVIDIA Nemotron-Labs Dory1.0): prelude, recurrent and coda sections
of nGPT layers (model-families.md section 2).

Forward: e = embed(ids); the prelude's layers run once on e (their output p); the loop input is
inject = unit(p); each loop sets h = unit(h) + inject (h = p before loop 1) and runs the
recurrent layers; after the last loop the coda's layers run once, then unit(h) and the head,
whose logits are scaled per token (`logit_scale`). unit(x) = x / sqrt(sum(x^2) + 1e-6), in fp32.

An nGPT layer keeps its state on the unit sphere and moves it toward each normalized update at
a learned per-channel rate (`lambda_1`, `lambda_2`) instead of adding it:

    x = unit(h); a = unit(o(unit(sigmoid(g * s_g^2) * attn(q, k, v))))
    h = x + |lambda_1| * (a - x); y = unit(h)
    m = unit(down(unit(silu(gate(y) * s_gate) * up(y) * s_up))); h = y + |lambda_2| * (m - y)

q and k are unit-normed per head before RoPE, q is multiplied per channel by sqk^2 after it;
every learned scale is stored divided by its init and multiplied back (`_scales`). Layers
alternate sliding-window (window `sliding_window`, RoPE theta 1e4) and full attention (theta
1e7) as `layer_types` says.

State: [h, inject] ([N, 2d]). KV: the prelude's and coda's layers keep one slot each on the
stage plane (`KVPlan.stage_layers`); the recurrent layers one plane per loop (`per_loop`), or
one plane all loops overwrite (`last_loop`: earlier loops read the past's last-loop keys and
their own, as transformers' cached generation defines it; the engine then prefills a prompt
whole). No exit signal; the depth is elastic: a request may run 1 up to the engine's cap loops
(by default twice the checkpoint's `n_recurrent_loops`).

Config, declaration and checkpoint names: dory_config.py.
"""

from __future__ import annotations

import torch
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import ngpt_ops
from rlt_models.attention_layer import fused_linear
from rlt_models.dory_config import FULL, SLIDING, DoryConfig
from rlt_models.layers import RotaryEmbedding, empty_parameter
from rlt_models.looped_model import LoopedModelBase
from rlt_models.ngpt_layer import DerivedTensors, NGPTLayer, run_eager_layers, run_fused_layers
from rlt_models.ngpt_ops import unit_reference as unit


class DoryModel(LoopedModelBase):
    """Dory with the `LoopedLanguageModel` interface: `embed` runs the prelude and `finish`
    the coda, both on the stage plane (`positions` and `attention` required); the state is
    [h, unit(prelude output)].

    `fused_path` (`LoopedModelBase`) picks each stage's path: eager (`NGPTLayer.forward`) or
    fused (`NGPTLayer.forward_fused` with the `ngpt_ops` of `fused_impl(hidden)`, projections
    through `fused_linear`: the batch-invariant GEMM in batch-invariant mode). The fused path
    carries x = unit(h) between layers: a stage starts with one `unit_norm`, a loop with one
    `unit_add_unit` (unit(unit(h) + inject)), and the prelude's last layer gives unit(p) too.
    """

    def __init__(self, config: DoryConfig) -> None:
        super().__init__(config, config.declaration())
        self.layers = nn.ModuleList(
            NGPTLayer(
                config,
                window=config.sliding_window if kind == SLIDING else None,
                full_rope=kind == FULL,
            )
            for kind in config.layer_types
        )
        self.full_rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta_full, config.max_position_embeddings
        )
        self.logit_scale = empty_parameter(config.vocab_size)
        self._derived_logit_scale = DerivedTensors()
        first, last = config.n_input_layers, config.n_input_layers + config.n_recurrent_layers
        self.prelude_layers = self.layers[:first]
        self.recurrent_layers = self.layers[first:last]
        self.coda_layers = self.layers[last:]

    def _rope(self, positions, dtype):
        table = self.batch_invariant
        return (
            self.rotary.cos_sin(positions, dtype, table=table),
            self.full_rotary.cos_sin(positions, dtype, table=table),
        )

    def _stage(self, layers, h, positions, attention, first_slot: int, needed=None):
        """A stage's layers on h at stage slots first_slot.. -> (their output, its unit on the
        fused path, else None). `needed` (device int32 [1] or None): where 0 no row keeps the
        result, and the fused path's small-batch projections read no weight."""
        if attention is None or positions is None:
            raise ValueError("Dory's prelude and coda attend: pass positions and attention")
        rope = self._rope(positions, h.dtype)
        impl = self.fused_impl(h)
        if impl is None or not layers:
            return run_eager_layers(layers, h, rope, attention, first_slot, self.ops), None
        linear = fused_linear(impl, self.batch_invariant)
        x = ngpt_ops.unit_norm(h, impl=impl)
        return run_fused_layers(
            layers, x, rope, attention, first_slot, linear=linear, impl=impl, needed=needed
        )

    def embed(self, token_ids, positions=None, attention=None, *, needed=None) -> torch.Tensor:
        """The prelude: [p, unit(p)] of the embedded tokens (stage slots 0..)."""
        p, unit_p = self._stage(
            self.prelude_layers, super().embed(token_ids), positions, attention, 0, needed
        )
        return torch.cat([p, unit(p) if unit_p is None else unit_p], dim=-1)

    def recurrent_step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[torch.Tensor, None]:
        """One loop: h = unit(h) + inject, then the recurrent layers (no exit gate)."""
        h, inject = hidden.split(self.config.hidden_size, dim=-1)
        rope = self._rope(positions, hidden.dtype)
        impl = self.fused_impl(hidden)
        if impl is None:
            h = run_eager_layers(
                self.recurrent_layers, unit(h) + inject, rope, attention, 0, self.ops
            )
        else:
            x = ngpt_ops.unit_add_unit(h, inject, impl=impl)
            linear = fused_linear(impl, self.batch_invariant)
            h, _ = run_fused_layers(
                self.recurrent_layers, x, rope, attention, 0, linear=linear, impl=impl
            )
        return torch.cat([h, inject], dim=-1), None

    def finish(self, hidden, positions, attention, *, needed=None) -> torch.Tensor:
        """The coda's layers on a token's final state (stage slots after the prelude's)."""
        h, inject = hidden.split(self.config.hidden_size, dim=-1)
        first_slot = self.config.n_input_layers
        h, _ = self._stage(self.coda_layers, h, positions, attention, first_slot, needed)
        return torch.cat([h, inject], dim=-1)

    def coda(self, hidden: torch.Tensor, *, needed: torch.Tensor | None = None) -> torch.Tensor:
        """unit(h), the head, and the per-token logit scale (derived once: `DerivedTensors`)."""
        h = hidden[:, : self.config.hidden_size]
        impl = self.fused_impl(hidden)
        h = unit(h.contiguous()) if impl is None else ngpt_ops.unit_norm(h, impl=impl)
        logits = super().coda(h, needed=needed)
        scale = self._derived_logit_scale.get(
            (self.logit_scale,), lambda: self.logit_scale.float() / self.config.initializer_range
        )
        return (logits.float() * scale).to(logits.dtype)
