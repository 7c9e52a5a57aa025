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

import logging
from dataclasses import dataclass

from msgspec.structs import replace
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
    config: EngineConfig  # with the family's KV layout and whole-prompt batching if it needs them
    exit_policy: ExitPolicy
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
    runner, scheduler = config.runner, config.scheduler
    exit_policy = make_exit_policy(
        scheduler.exit_policy or default_exit_policy(family.exit_signal),
        exit_trace=scheduler.exit_trace,
        model_depth=model_depth,
    )
    if exit_policy.reads_distribution and runner.speculation.num_tokens > 0:
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
    if not family.kv.per_loop and runner.layout.kind is not KVLayout.SHARED:
        runner = replace(runner, kv_layout="shared")
        logger.info(
            "%s keeps one KV plane that every loop overwrites (its checkpoint's KV mode): "
            "kv_layout shared",
            family.name,
        )
    prefix_lm = family.prompt_mask is PromptMask.PREFIX_LM
    folded = runner.layout.folds_loops(model_depth)
    # a prompt is one block (prefix-LM: bidirectional; a one-plane KV plan or a ring of fewer
    # planes than loops: its earlier loops see the prompt's own keys): computed in one step,
    # never chunked
    whole_prompts = prefix_lm or not family.kv.per_loop or folded
    if whole_prompts:
        scheduler = replace(
            scheduler,
            prefill_chunk_size=max_model_len,
            max_num_batched_tokens=max(scheduler.max_num_batched_tokens, max_model_len),
            whole_prompts=True,
        )
        logger.info(
            "%s prompts are %s: each is prefilled whole in one step (chunked prefill off; "
            "token budget %d = the context length at least)",
            family.name,
            "prefix-LM blocks"
            if prefix_lm
            else f"one block for its {runner.kv_layout} KV planes"
            if folded and family.kv.per_loop
            else "one block for its shared KV plane",
            scheduler.max_num_batched_tokens,
        )
    if family.random_initial_state:
        logger.info(
            "%s starts each token's loop state %s (initial_state=%s)",
            family.name,
            "from a random draw of its request's seed and position"
            if runner.initial_state == "random"
            else "at zero",
            runner.initial_state,
        )
    gated = family.exit_signal is ExitSignal.GATE
    return FamilySetup(
        config=replace(config, runner=runner, scheduler=scheduler),
        exit_policy=exit_policy,
        default_min_loops=DEFAULT_GATE_MIN_LOOPS if gated else 1,
    )


def check_family_features(config: EngineConfig, family: FamilyDeclaration) -> None:
    """Refuse, with the family's reason, an engine option its declaration does not support."""
    asked = {
        Feature.CHUNKED_PREFILL: config.scheduler.prefill_chunk_size is not None,
        Feature.PREFIX_CACHING: config.scheduler.enable_prefix_caching,
        Feature.SHARED_KV: config.runner.layout.kind is KVLayout.SHARED,
        Feature.SPECULATIVE_DECODING: config.runner.speculation.num_tokens > 0,
        Feature.FP8_WEIGHTS: config.model.quantization == "fp8",
        Feature.FP8_KV: config.runner.kv_cache_dtype == "fp8",
        Feature.PD: config.pd.role is not PDRole.NONE,
    }
    for feature, used in asked.items():
        reason = family.refusal(feature) if used else None
        if reason is not None:
            raise ConfigurationError(feature.value, reason)


def check_layout_features(config: EngineConfig, *, model_depth: int) -> None:
    """Refuse the engine options a ring KV layout cannot keep exact (module doc), naming the
    layout and what would work."""
    layout = config.runner.layout
    if layout.kind is not KVLayout.RING:
        return
    if config.runner.speculation.num_tokens > 0:
        raise ConfigurationError(
            ("kv_layout", "num_speculative_tokens"),
            f"kv_layout {layout} (a ring of step planes): speculative rounds draft and verify "
            "at per-loop planes (last_exited) or one plane (shared); use one of those layouts "
            "or no speculation",
        )
    if config.scheduler.enable_prefix_caching and layout.folds_loops(model_depth):
        raise ConfigurationError(
            ("kv_layout", "enable_prefix_caching"),
            f"kv_layout {layout} keeps {layout.ring_planes} planes for up to {model_depth} "
            "loops: a cached prompt page holds each plane's latest loop, where the same prompt "
            "computed whole reads every loop's own KV, so prefix hits would differ from misses; "
            f"use ring:{model_depth} or more planes, last_exited, or no prefix caching",
        )
