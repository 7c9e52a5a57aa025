"""`NGPTLayer`: one nGPT layer of Dory (`rlt_models.dory`'s module doc gives the math), its eager
path (`forward`) and its fused path (`forward_fused`, the ops of `rlt_models.ngpt_ops`).

The eager path takes the layer's un-normed input h and returns the next h. The fused path takes
x = unit(h) (every use of h inside the layer is through x) and returns (h', unit(h')): the
last op of a layer is also the next layer's input norm, so a stack of layers is 4 GEMMs, the
attention and 5 fused kernels a layer (`run_fused_layers`).

The vectors derived from the learned scales ((sqk * sqk_scale)^2, |lambda_1 * lambda_scale|,
...) are computed once and kept (`DerivedTensors`), with the same torch ops in the parameters'
dtype as transformers' `DoryForCausalLM` computes them every call (so bit-identical); both
paths read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from rlt_contracts import LayerAttention
from torch import nn

from rlt_models import ngpt_ops
from rlt_models.fp8_linear import project
from rlt_models.layers import ModelOps, apply_rotary, empty_parameter
from rlt_models.ngpt_ops import unit_reference as unit


class DerivedTensors:
    """A value computed from parameters, kept until a parameter is replaced.

    Weights never change after loading (they are frozen and the engine only reads them), so the
    value is recomputed only when a source tensor is a different tensor than last time (another
    storage, dtype or device: `model.to(...)`, a new load). It holds its sources' tensors, so
    a replaced parameter's memory cannot be reused at the same address and be taken for it.
    NOT seen: an in-place write into a parameter after the first call (call `clear()`).
    A value first needed inside a CUDA-graph capture is computed for that graph and not kept:
    its memory belongs to the graph's pool and holds values only during replays (the engine's
    eager warm-ups run before every capture, so the value is kept by then).
    """

    def __init__(self) -> None:
        self._sources: tuple[torch.Tensor, ...] = ()
        self._value = None

    def get(self, sources: tuple[torch.Tensor, ...], compute: Callable[[], object]):
        kept = self._sources
        if len(kept) != len(sources) or any(
            a.data_ptr() != b.data_ptr() or a.dtype != b.dtype or a.device != b.device
            for a, b in zip(kept, sources, strict=True)
        ):
            value = compute()
            if sources[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return value
            self._sources, self._value = tuple(t.detach() for t in sources), value
        return self._value

    def clear(self) -> None:
        self._sources, self._value = (), None


class LayerConstants(NamedTuple):
    """An nGPT layer's derived scales, in the parameters' dtype."""

    q_scale: torch.Tensor  # [H * D] (sqk * sqk_scale)^2
    gate_scale: torch.Tensor  # [H * D] (s_gate * s_gate_scale)^2
    suv_gate: torch.Tensor  # [F] suv_gate * suv_scale
    suv_up: torch.Tensor  # [F] suv_up * suv_scale
    attention_rate: torch.Tensor  # [d] |lambda_1 * lambda_scale|
    mlp_rate: torch.Tensor  # [d] |lambda_2 * lambda_scale|


class NGPTLayer(nn.Module):
    """One nGPT layer; `window` is its sliding window (None: full attention), `full_rope`
    whether it takes the full-attention RoPE (index 1 of the model's `rope` pair)."""

    def __init__(self, config, *, window: int | None, full_rope: bool) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split = (q, kv, kv, q)
        self.intermediate_size = f
        self.qkvg_proj = empty_parameter(2 * q + 2 * kv, d)
        self.o_proj = empty_parameter(d, q)
        self.gate_up_proj = empty_parameter(2 * f, d)
        self.down_proj = empty_parameter(d, f)
        self.sqk = empty_parameter(q)
        self.s_gate = empty_parameter(q)
        self.suv_gate = empty_parameter(f)
        self.suv_up = empty_parameter(f)
        self.lambda_1 = empty_parameter(d)
        self.lambda_2 = empty_parameter(d)
        self.window = window
        self.full_rope = full_rope
        init = config.initializer_range
        self.sqk_scale = self.head_dim**0.5 / init
        self.s_gate_scale = d**0.25 / init
        self.suv_scale = d**0.5
        self.lambda_scale = config.ngpt_alpha_init / init
        self._derived = DerivedTensors()

    def constants(self) -> LayerConstants:
        """The derived scales (computed on first use, then kept: `DerivedTensors`)."""
        sources = (self.sqk, self.s_gate, self.suv_gate, self.suv_up, self.lambda_1, self.lambda_2)
        return self._derived.get(sources, self._compute_constants)

    def _compute_constants(self) -> LayerConstants:
        return LayerConstants(
            q_scale=(self.sqk * self.sqk_scale).square(),
            gate_scale=(self.s_gate * self.s_gate_scale).square(),
            suv_gate=self.suv_gate * self.suv_scale,
            suv_up=self.suv_up * self.suv_scale,
            attention_rate=(self.lambda_1 * self.lambda_scale).abs(),
            mlp_rate=(self.lambda_2 * self.lambda_scale).abs(),
        )

    def forward(self, h, rope, attention: LayerAttention, slot: int, ops: ModelOps):
        """Eager: the layer's input h [N, d] -> its output h [N, d]."""
        n, c = h.shape[0], self.constants()
        cos, sin = rope[self.full_rope]
        x = unit(h)
        q, k, v, g = project(ops.linear, x, self.qkvg_proj).split(self.split, dim=-1)
        q = apply_rotary(unit(q.reshape(n, self.heads, self.head_dim)), cos, sin)
        k = apply_rotary(unit(k.reshape(n, self.kv_heads, self.head_dim)), cos, sin)
        q = q * c.q_scale.view(self.heads, self.head_dim)
        out = attention(
            slot, q, k, v.reshape(n, self.kv_heads, self.head_dim), window=self.window
        ).reshape(n, -1)
        out = out * ops.sigmoid(g * c.gate_scale)
        a = unit(project(ops.linear, unit(out), self.o_proj))
        h = x + c.attention_rate * (a - x)
        y = unit(h)
        gate, up = project(ops.linear, y, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        act = ops.silu(gate * c.suv_gate) * (up * c.suv_up)
        m = unit(project(ops.linear, unit(act), self.down_proj))
        return y + c.mlp_rate * (m - y)

    def forward_fused(
        self,
        x,
        rope,
        attention: LayerAttention,
        slot: int,
        *,
        linear,
        impl: str,
        keep_h: bool,
        needed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Fused: x = unit(h) [N, d] -> (h', unit(h')); h' is None unless `keep_h` (only a
        stack's last layer needs it). `linear`: the projection (`fused_linear`); `impl`: the
        `ngpt_ops` impl; `needed` (device int32 [1] or None): where 0 no row keeps the result
        and a small-batch Triton projection reads no weight. Kernels: 4 GEMMs, the
        attention's and 5 of `ngpt_ops`."""
        n, c = x.shape[0], self.constants()
        cos, sin = rope[self.full_rope]
        qkvg = project(linear, x, self.qkvg_proj, needed)
        q, k = ngpt_ops.qk_unit_rope_scale_(
            qkvg, cos, sin, self.heads, self.kv_heads, self.head_dim, c.q_scale, impl=impl
        )
        _, _, v, g = ngpt_ops.qk_heads(qkvg, self.heads, self.kv_heads, self.head_dim)
        out = attention(slot, q, k, v, window=self.window).reshape(n, -1)
        gated = ngpt_ops.gated_unit(out, g, c.gate_scale, impl=impl)
        raw = project(linear, gated, self.o_proj, needed)
        _, y = ngpt_ops.unit_interpolate(x, raw, c.attention_rate, keep_h=False, impl=impl)
        gate_up = project(linear, y, self.gate_up_proj, needed)
        act = ngpt_ops.scaled_silu_unit(
            gate_up, c.suv_gate, c.suv_up, self.intermediate_size, impl=impl
        )
        raw = project(linear, act, self.down_proj, needed)
        return ngpt_ops.unit_interpolate(y, raw, c.mlp_rate, keep_h=keep_h, impl=impl)


def run_eager_layers(layers, h, rope, attention, first_slot: int, ops: ModelOps):
    """`layers` on the eager path at KV slots first_slot..: h -> the last layer's h."""
    for index, layer in enumerate(layers):
        h = layer(h, rope, attention, first_slot + index, ops)
    return h


def run_fused_layers(
    layers, x, rope, attention, first_slot: int, *, linear, impl: str, needed=None
):
    """`layers` (at least one) on the fused path at KV slots first_slot..: x = unit(h) ->
    (the last layer's h, its unit). `needed`: `NGPTLayer.forward_fused`'s."""
    h = None
    for index, layer in enumerate(layers):
        keep_h = index + 1 == len(layers)
        h, x = layer.forward_fused(
            x,
            rope,
            attention,
            first_slot + index,
            linear=linear,
            impl=impl,
            keep_h=keep_h,
            needed=needed,
        )
    return h, x
