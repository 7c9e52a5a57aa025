"""What a model family's declaration decides about an engine (read once at start-up).

`family_setup` turns the loaded model's `FamilyDeclaration` into engine choices, never testing
the family's name: the exit policy (the family's own signal unless `exit_policy` names one; a
policy that reads a signal the family does not produce is refused), the options the family
declares unsupported (refused with its reason), whole-prompt prefill for a prefix-LM prompt
(the token budget and chunk raised to the context length), and the default `min_loops`. The
start-up log names the default depth and the loop cap (`model_depth`, `max_model_loops`).
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
    if not family.kv.per_loop and config.kv_layout != "shared":
        config = dataclasses.replace(config, kv_layout="shared")
        logger.info(
            "%s keeps one KV plane that every loop overwrites (its checkpoint's KV mode): "
            "kv_layout shared",
            family.name,
        )
    prefix_lm = family.prompt_mask is PromptMask.PREFIX_LM
    # a prompt is one block (prefix-LM: bidirectional; a one-plane KV plan: its earlier loops
    # see the prompt's own keys): computed in one step, never chunked
    whole_prompts = prefix_lm or not family.kv.per_loop
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
            "prefix-LM blocks" if prefix_lm else "one block for its shared KV plane",
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
        Feature.SHARED_KV: config.kv_layout == "shared",
        Feature.SPECULATIVE_DECODING: config.num_speculative_tokens > 0,
        Feature.FP8_WEIGHTS: config.quantization == "fp8",
        Feature.FP8_KV: config.kv_cache_dtype == "fp8",
        Feature.PD: config.role is not PDRole.NONE,
    }
    for feature, used in asked.items():
        reason = family.refusal(feature) if used else None
        if reason is not None:
            raise ConfigurationError(feature.value, reason)
