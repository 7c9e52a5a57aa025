"""What a looped model family declares, so that nothing outside its module branches on its name.

Every looped family is embed -> prelude layers (once per token) -> a recurrent block applied
once per loop -> coda layers (once) -> head. A `FamilyDeclaration` says, for one family:

- its stages (`StagePlan`: layers of the prelude, the recurrent block and the coda),
- the state one loop carries (`state`: named vectors of the hidden width; the runner keeps
  `len(state) * hidden_size` values per row and PD hands all of them over),
- how loop k + 1's input is formed from loop k's output (`loop_input`, for people),
- its KV plan (`kv`: KV layer slots per plane, where one plane is one loop),
- its exit signal (`exit_signal`: a learned gate, or none: the depth is then fixed per request),
- its depth (`default_loops`, what a request runs when it does not say; `max_loops`, the
  engine's default cap on what a request may ask, which the model depth T and the KV are
  sized for; `loop_limit`, the largest cap an engine may set with `max_model_loops`),
- its prompt mask (`prompt_mask`: causal, or prefix-LM: the prompt is one bidirectional block),
- the engine features it cannot support, each with the reason (`unsupported`), so start-up or
  the request fails with that reason (R13, R14) instead of computing something else.

The scheduler, logical KV, runner, attention and PD read these fields; the family's module in
rlt-models computes. Adding a family is its module and its registration there.
"""

from __future__ import annotations

import enum

import msgspec

# The exit threshold servers and `rlt generate` use for a family with an exit gate when
# neither the request nor the command line gives one (families without a signal: fixed depth).
DEFAULT_GATE_EXIT_THRESHOLD = 0.5
# The first loop after which a gated family's token may exit when the request does not say
# (families without a signal: 1; `SamplingParams.resolve_min_loops`).
DEFAULT_GATE_MIN_LOOPS = 2


class ExitSignal(enum.StrEnum):
    """What a loop produces that an exit rule can read.

    GATE           a learned exit probability per loop (Ouro): rules "hazard" / "hazard_delayed"
                   (aliases "ouro" / "ouro_delayed") / "trace".
    LATENT_CHANGE  (0.3.3) how far one loop moved the state, ||s_k - s_{k-1}|| / ||s_k|| in fp32
                   (Huginn; s_0 the initial state): rules "latent_diff" / "latent_diff_delayed"
                   exit once it falls below the threshold / "trace".
    NONE           nothing: every token runs its request's `max_loops` (rule "fixed", or "trace").
    """

    GATE = "gate"
    LATENT_CHANGE = "latent_change"
    NONE = "none"


class PromptMask(enum.StrEnum):
    """How prompt positions see each other at prefill (decode is causal for every family).

    CAUSAL     position p sees positions <= p.
    PREFIX_LM  the whole prompt is one bidirectional block, prefilled in one pass.
    """

    CAUSAL = "causal"
    PREFIX_LM = "prefix_lm"


class Feature(enum.StrEnum):
    """Engine features a family may declare unsupported (the names of `EngineConfig` options)."""

    CHUNKED_PREFILL = "chunked_prefill"
    PREFIX_CACHING = "prefix_caching"
    SHARED_KV = "shared_kv_layout"
    SPECULATIVE_DECODING = "speculative_decoding"
    FP8_WEIGHTS = "fp8_weights"
    FP8_KV = "fp8_kv_cache"
    PD = "prefill_decode_disaggregation"
    EXIT_DEPTH_SCORING = "score_at_exit_depth"


class StagePlan(msgspec.Struct, frozen=True):
    """Physical layers of each stage (a nested block counts each layer once)."""

    core_layers: int
    prelude_layers: int = 0
    coda_layers: int = 0


class KVPlan(msgspec.Struct, frozen=True):
    """The KV one token position keeps.

    layers_per_plane: KV layer slots of one plane; a plane is one loop of the recurrent block
      (a block that runs its stack several times per loop, as HRM-Text's cycles, keeps a slot
      per (pass, layer) in the loop's plane).
    per_loop: one plane per loop (True), so a query at loop k reads loop k's keys; the
      `last_exited` layout then copies an exited token's KV into the deeper planes. False: the
      family's own KV is one plane that every loop overwrites (Dory's `last_loop`): the engine
      uses the `shared` layout, and a prompt runs depth-major as one whole block (loop k of
      every prompt position, then loop k + 1), so earlier loops see the prompt's own loop-k
      keys beside the past's final ones, as the family's reference defines it.
    stage_layers (0.3.1): layers outside the recurrent block that keep KV (prelude then coda,
      run once per token); they take slots 0.. of one more plane, the stage plane, after the
      loop planes, and the model's `embed` (prelude) / `finish` (coda) attend through it.
    sliding_window (0.3.1): some layer attends only to its last `window` positions (it passes
      `window` to its `LayerAttention`); the attention backend must declare support.
    """

    layers_per_plane: int
    per_loop: bool = True
    stage_layers: int = 0
    sliding_window: bool = False

    @property
    def stage_planes(self) -> int:
        """Planes after the loop planes: one when stage layers keep KV."""
        return 1 if self.stage_layers else 0


class FamilyDeclaration(msgspec.Struct, frozen=True):
    """One looped family's static description (see the module doc)."""

    name: str  # short, lower case ("ouro"): logs, /v1/models, docs
    architecture: str  # config.json's `architectures` entry that selects it
    stages: StagePlan
    state: tuple[str, ...]  # the vectors a loop carries, each of the hidden width
    loop_input: str  # how loop k + 1's input is formed (for people)
    kv: KVPlan
    exit_signal: ExitSignal
    default_loops: int  # loops a request runs when it does not say
    max_loops: int  # the engine's default cap on a request's loops (KV is sized for the cap)
    # (0.3.1) the largest cap an engine may set (`max_model_loops`); None: any (elastic depth)
    loop_limit: int | None = None
    prompt_mask: PromptMask = PromptMask.CAUSAL
    unsupported: tuple[tuple[Feature, str], ...] = ()  # (feature, why not)
    # (0.3.4) the loop state starts from a random draw, seeded per request and position
    # (`embed(..., uniforms=...)`); the engine's `initial_state="zero"` starts it at zero
    random_initial_state: bool = False

    def refusal(self, feature: Feature) -> str | None:
        """Why this family cannot run `feature`, or None when it can."""
        for name, reason in self.unsupported:
            if name is feature:
                return (
                    f"{self.name} ({self.architecture}) does not support {feature.value}: {reason}"
                )
        return None
