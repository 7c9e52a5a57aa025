"""What a model family's declaration decides about an engine (read once at start-up).

`family_setup` turns the loaded model's `FamilyDeclaration` into engine choices, never testing
the family's name: the exit policy (the family's own signal unless `exit_policy` names one; a
policy that reads a signal the family does not produce is refused), the options the family
declares unsupported (refused with its reason), whole-prompt prefill for a prefix-LM prompt
(the token budget and chunk raised to the context length), and the default `min_loops`. The
start-up log names the default depth and the loop cap (`model_depth`, `max_model_loops`).

The KV layout's own limits are checked here too, against the loop cap (`check_layout_features`):
a ring of K < cap planes ("ring:K", `KVLayoutSpec.folds_loops`) keeps in each plane the latest
of several loops, so what a prompt leaves depends on how it was computed: its prompts are
prefilled whole (loop by loop over the whole prompt, as the authors' code runs a prompt), and
prefix caching is refused (a hit's pages hold the latest loops, where a miss's suffix would read
each loop's own). Speculative rounds (draft and verify at per-loop planes) and exit-depth
scoring read last_exited or shared KV only: refused with any ring (scoring per request, by
the engine core).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from rlt_contracts import (
    DEFAULT_GATE_MIN_LOOPS,
    ConfigurationError,
    ExitSignal,
    FamilyDeclaration,
    Feature,
    KVLayout,
    PDRole,
    PromptMask,
)
from rlt_scheduler import ExitPolicy, default_exit_policy, make_exit_policy

from rlt.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilySetup:
    config: EngineConfig  # with whole-prompt batching where the family needs it
    exit_policy: ExitPolicy
    whole_prompts: bool  # prompts are prefilled whole (prefix-LM, or a one-plane KV plan)
    default_min_loops: int  # a request's min_loops when it sets none


def family_setup(
    config: EngineConfig, family: FamilyDeclaration, *, model_depth: int, max_model_len: int
) -> FamilySetup:
    logger.info(
        "model family %s (%s): %d loops by default, at most %d per request "
        "(max_model_loops; KV sized for it), exit signal %s",
        family.name,
        family.architecture,
        family.default_loops,
        model_depth,
        family.exit_signal.value,
    )
    check_family_features(config, family)
    check_layout_features(config, model_depth=model_depth)
    exit_policy = make_exit_policy(
        config.exit_policy or default_exit_policy(family.exit_signal),
        exit_trace=config.exit_trace,
        model_depth=model_depth,
    )
    if exit_policy.reads_distribution and config.num_speculative_tokens > 0:
        raise ConfigurationError(
            ("exit_policy", "num_speculative_tokens"),
            f"{exit_policy.name!r} reads the next-token distribution after every loop, which "
            "speculative rounds do not compute; use another exit policy or no speculation",
        )
    if exit_policy.reads is not None and exit_policy.reads is not family.exit_signal:
        raise ConfigurationError(
            "exit_policy",
            f"{exit_policy.name!r} reads the model's {exit_policy.reads.value} signal, which "
            f"{family.name} does not produce (exit signal: {family.exit_signal.value}); use "
            f"{default_exit_policy(family.exit_signal)!r} or 'trace'",
        )
    if not family.kv.per_loop and config.layout.kind is not KVLayout.SHARED:
        config = dataclasses.replace(config, kv_layout="shared")
        logger.info(
            "%s keeps one KV plane that every loop overwrites (its checkpoint's KV mode): "
            "kv_layout shared",
            family.name,
        )
    prefix_lm = family.prompt_mask is PromptMask.PREFIX_LM
    folded = config.layout.folds_loops(model_depth)
    # a prompt is one block (prefix-LM: bidirectional; a one-plane KV plan or a ring of fewer
    # planes than loops: its earlier loops see the prompt's own keys): computed in one step,
    # never chunked
    whole_prompts = prefix_lm or not family.kv.per_loop or folded
    if whole_prompts:
        config = dataclasses.replace(
            config,
            prefill_chunk_size=max_model_len,
            max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len),
        )
        logger.info(
            "%s prompts are %s: each is prefilled whole in one step (chunked prefill off; "
            "token budget %d = the context length at least)",
            family.name,
            "prefix-LM blocks"
            if prefix_lm
            else f"one block for its {config.kv_layout} KV planes"
            if folded and family.kv.per_loop
            else "one block for its shared KV plane",
            config.max_num_batched_tokens,
        )
    if family.random_initial_state:
        logger.info(
            "%s starts each token's loop state %s (initial_state=%s)",
            family.name,
            "from a random draw of its request's seed and position"
            if config.initial_state == "random"
            else "at zero",
            config.initial_state,
        )
    gated = family.exit_signal is ExitSignal.GATE
    return FamilySetup(
        config=config,
        exit_policy=exit_policy,
        whole_prompts=whole_prompts,
        default_min_loops=DEFAULT_GATE_MIN_LOOPS if gated else 1,
    )


def check_family_features(config: EngineConfig, family: FamilyDeclaration) -> None:
    """Refuse, with the family's reason, an engine option its declaration does not support."""
    asked = {
        Feature.CHUNKED_PREFILL: config.prefill_chunk_size is not None,
        Feature.PREFIX_CACHING: config.enable_prefix_caching,
        Feature.SHARED_KV: config.layout.kind is KVLayout.SHARED,
        Feature.SPECULATIVE_DECODING: config.num_speculative_tokens > 0,
        Feature.FP8_WEIGHTS: config.quantization == "fp8",
        Feature.FP8_KV: config.kv_cache_dtype == "fp8",
        Feature.PD: config.role is not PDRole.NONE,
    }
    for feature, used in asked.items():
        reason = family.refusal(feature) if used else None
        if reason is not None:
            raise ConfigurationError(feature.value, reason)


def check_layout_features(config: EngineConfig, *, model_depth: int) -> None:
    """Refuse the engine options a ring KV layout cannot keep exact (module doc), naming the
    layout and what would work."""
    layout = config.layout
    if layout.kind is not KVLayout.RING:
        return
    if config.num_speculative_tokens > 0:
        raise ConfigurationError(
            ("kv_layout", "num_speculative_tokens"),
            f"kv_layout {layout} (a ring of step planes): speculative rounds draft and verify "
            "at per-loop planes (last_exited) or one plane (shared); use one of those layouts "
            "or no speculation",
        )
    if config.enable_prefix_caching and layout.folds_loops(model_depth):
        raise ConfigurationError(
            ("kv_layout", "enable_prefix_caching"),
            f"kv_layout {layout} keeps {layout.ring_planes} planes for up to {model_depth} "
            "loops: a cached prompt page holds each plane's latest loop, where the same prompt "
            "computed whole reads every loop's own KV, so prefix hits would differ from misses; "
            f"use ring:{model_depth} or more planes, last_exited, or no prefix caching",
        )
