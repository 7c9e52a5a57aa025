"""Token-by-token generation oracle with rlt's exit and KV-layout semantics, in float64.

Semantics (anchor-vllm-rlt.md 2a-2c), restated independently of the engine:
- Prefill runs every prompt position at full depth T. LAST_EXITED: plane d holds each prompt
  position's loop-(d+1) KV (depth-major). SHARED: positions advance one at a time through all
  loops, each loop overwriting the single plane, so later positions read final versions.
  RING ("ring:K"): K planes, loop k at plane (k - 1) mod K; the prompt runs depth-major as one
  block (at loop k every prompt position reads the prompt's loop-k KV, then it stays in its
  plane until loop k + K overwrites it).
- Token 0 comes from the last prompt position's final state (exit depth T).
- Output token i (i >= 1) is produced by feeding token i-1 at position P + i - 1 and looping:
  loop k reads plane(k) of earlier positions plus its own fresh entry. After each loop
  survival *= 1 - sigmoid(gate); exit at k if k == max_loops, or (threshold < 1,
  k >= min_loops and 1 - survival >= threshold). LAST_EXITED copies the exit-depth entry into
  the deeper planes; RING into planes k..K-1 when k < K (the planes the token never wrote).
- Greedy decoding; EOS (unless ignore_eos) and stop ids end with "stop", max_tokens with "length".
- `prompt_at_exit_depth` (score_at_exit_depth): no prefill; the prompt is decoded teacher-forced
  from position 0, every position looping under the exit rule exactly as an output token does,
  and token 0 comes from the last prompt position's exit state (its exit depth).

The oracle also reports how close each decision came to flipping (gate CDF vs threshold, and
the top-2 logit gap), so tests can assert the engine comparison is well conditioned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oracle.dense_ouro import DenseOuro, LayerKV


@dataclass(frozen=True)
class OracleRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    min_loops: int = 2
    max_loops: int | None = None
    threshold: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    exit_policy: str = "ouro"  # or "ouro_delayed"
    prompt_at_exit_depth: bool = False


@dataclass
class OracleResult:
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    finish_reason: str = ""
    min_gate_margin: float = float("inf")
    min_logit_margin: float = float("inf")
    # prompt_at_exit_depth: per prompt token, its log-probability and the loops of the state
    # that scored it (None for token 0)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_exit_depths: list[int | None] = field(default_factory=list)


class _PlaneKV:
    """Per-plane, per-layer KV rows indexed by position (float64)."""

    def __init__(
        self, planes: int, layers: int, capacity: int, kv_heads: int, head_dim: int, dtype
    ):
        shape = (planes, layers, capacity, kv_heads, head_dim)
        self.keys = torch.full(shape, float("nan"), dtype=dtype)
        self.values = torch.full(shape, float("nan"), dtype=dtype)

    def past(self, plane: int, end: int) -> list[LayerKV]:
        return [
            LayerKV(self.keys[plane, layer, :end], self.values[plane, layer, :end])
            for layer in range(self.keys.shape[1])
        ]

    def store(self, plane: int, start: int, new: list[LayerKV]) -> None:
        for layer, kv in enumerate(new):
            n = kv.keys.shape[0]
            self.keys[plane, layer, start : start + n] = kv.keys
            self.values[plane, layer, start : start + n] = kv.values

    def copy_position(self, source_plane: int, target_planes: range, position: int) -> None:
        for plane in target_planes:
            self.keys[plane, :, position] = self.keys[source_plane, :, position]
            self.values[plane, :, position] = self.values[source_plane, :, position]


class GenerationOracle:
    def __init__(
        self, dense: DenseOuro, layout: str, eos_token_ids: tuple[int, ...] = (0,)
    ) -> None:
        self.ring = int(layout.removeprefix("ring:")) if layout.startswith("ring:") else 0
        if layout not in ("last_exited", "shared") and self.ring < 1:
            raise ValueError(layout)
        self.dense = dense
        self.layout = layout
        self.eos = set(eos_token_ids)

    def plane(self, loop: int) -> int:
        if self.ring:
            return (loop - 1) % self.ring
        return loop - 1 if self.layout == "last_exited" else 0

    @property
    def planes(self) -> int:
        """Planes one position keeps."""
        if self.ring:
            return min(self.ring, self.dense.loops)
        return self.dense.loops if self.layout == "last_exited" else 1

    def generate(self, request: OracleRequest) -> OracleResult:
        d, depth = self.dense, self.dense.loops
        max_loops = request.max_loops or depth
        prompt_len = len(request.prompt)
        kv = _PlaneKV(
            self.planes,
            d.num_layers,
            prompt_len + request.max_tokens,
            d.num_kv_heads,
            d.head_dim,
            d.dtype,
        )
        result = OracleResult()
        if request.prompt_at_exit_depth and self.ring:
            raise ValueError("exit-depth scoring is not defined for a ring")
        if request.prompt_at_exit_depth:
            self._teacher_forced_prompt(request, kv, max_loops, result)
        else:
            final = self._prefill(request.prompt, kv)[-1:]
            self._emit(result, d.lm_head(final)[0], depth)
        while True:
            reason = self._finish_reason(request, result)
            if reason:
                result.finish_reason = reason
                return result
            position = prompt_len + len(result.token_ids) - 1
            x, loop = self._decode_position(
                request, kv, result.token_ids[-1], position, max_loops, result
            )
            self._emit(result, d.lm_head(x)[0], loop)

    def _teacher_forced_prompt(
        self, request: OracleRequest, kv: _PlaneKV, max_loops: int, result: OracleResult
    ) -> None:
        """Decode the prompt from position 0, each position fed its prompt token: records the
        prompt's scores and depths, then token 0 from the last position's exit state."""
        prompt = request.prompt
        result.prompt_logprobs.append(None)
        result.prompt_exit_depths.append(None)
        for position, token in enumerate(prompt):
            x, loop = self._decode_position(request, kv, token, position, max_loops, result)
            logits = self.dense.lm_head(x)[0]
            if position + 1 < len(prompt):
                logprobs = torch.log_softmax(logits, dim=-1)
                result.prompt_logprobs.append(float(logprobs[prompt[position + 1]]))
                result.prompt_exit_depths.append(loop)
        self._emit(result, logits, loop)

    def _decode_position(
        self,
        request: OracleRequest,
        kv: _PlaneKV,
        token: int,
        position: int,
        max_loops: int,
        result: OracleResult,
    ) -> tuple[torch.Tensor, int]:
        """Feed `token` at `position` and loop until the exit rule fires (LAST_EXITED: its
        exit-depth KV copied into the deeper planes; RING: into the planes it never wrote);
        returns (exit state [1, d], depth)."""
        d = self.dense
        x = d.embed(torch.tensor([token]))
        survival, pending_exit, loop = 1.0, None, 0
        while True:
            loop += 1
            x, new_kv, gate = d.loop(
                x, torch.tensor([position]), kv.past(self.plane(loop), position)
            )
            kv.store(self.plane(loop), position, new_kv)
            survival *= 1.0 - float(torch.sigmoid(gate)[0])
            if self._exits(request, loop, max_loops, survival, result, pending_exit):
                break
            if (
                request.exit_policy == "ouro_delayed"
                and pending_exit is None
                and self._trigger(request, loop, survival, result)
            ):
                pending_exit = loop + 1
        if self.layout != "shared" and loop < self.planes:
            kv.copy_position(self.plane(loop), range(loop, self.planes), position)
        return x, loop

    def prompt_logprobs(self, prompt: tuple[int, ...]) -> list[float | None]:
        """log p(prompt[i] | prompt[:i]) under every position's final prefill state (None for
        token 0): what prompt scoring at full depth reports, in this layout's semantics."""
        d = self.dense
        kv = _PlaneKV(
            self.planes,
            d.num_layers,
            len(prompt),
            d.num_kv_heads,
            d.head_dim,
            d.dtype,
        )
        logprobs = torch.log_softmax(d.lm_head(self._prefill(prompt, kv)[:-1]), dim=-1)
        return [None] + [float(logprobs[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]

    def _prefill(self, prompt: tuple[int, ...], kv: _PlaneKV) -> torch.Tensor:
        """Every prompt position's final state [P, d]."""
        d = self.dense
        if self.layout != "shared":
            h = d.embed(torch.tensor(prompt))
            positions = torch.arange(len(prompt))
            for loop in range(1, d.loops + 1):
                h, new_kv, _ = d.loop(h, positions, [None] * d.num_layers)
                kv.store(self.plane(loop), 0, new_kv)
            return h
        states = []
        for position, token in enumerate(prompt):
            x = d.embed(torch.tensor([token]))
            for _ in range(d.loops):
                x, new_kv, _ = d.loop(x, torch.tensor([position]), kv.past(0, position))
                kv.store(0, position, new_kv)
            states.append(x)
        return torch.cat(states)

    def _trigger(
        self, request: OracleRequest, loop: int, survival: float, result: OracleResult
    ) -> bool:
        """The adaptive rule alone (without the max_loops cap); records the decision margin."""
        if request.threshold >= 1.0 or loop < request.min_loops:
            return False
        cdf = 1.0 - survival
        result.min_gate_margin = min(result.min_gate_margin, abs(cdf - request.threshold))
        return cdf >= request.threshold

    def _exits(self, request, loop, max_loops, survival, result, pending_exit) -> bool:
        if loop >= max_loops:
            return True
        if request.exit_policy == "ouro_delayed":
            return pending_exit is not None and loop >= pending_exit
        return self._trigger(request, loop, survival, result)

    def _emit(self, result: OracleResult, logits: torch.Tensor, depth: int) -> None:
        top2 = torch.topk(logits, 2).values
        result.min_logit_margin = min(result.min_logit_margin, float(top2[0] - top2[1]))
        result.token_ids.append(int(torch.argmax(logits)))
        result.exit_depths.append(depth)

    def _finish_reason(self, request: OracleRequest, result: OracleResult) -> str:
        last = result.token_ids[-1]
        if last in request.stop_token_ids or (last in self.eos and not request.ignore_eos):
            return "stop"
        if len(result.token_ids) >= request.max_tokens:
            return "length"
        return ""
