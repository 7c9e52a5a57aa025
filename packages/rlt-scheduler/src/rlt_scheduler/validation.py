"""Checks of a new request as it arrives (`Scheduler.add_requests`, before `intake.py`; typed
errors naming the field; nothing changes). Admission (waiting -> running) is `admitter.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlt_contracts import (
    DEFAULT_GATE_MIN_LOOPS,
    CapacityError,
    InvalidRequestError,
    KVPort,
    KVTransferParams,
    PDRole,
    SamplingParams,
)

from rlt_scheduler.exit_policy import LoopBounds


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: vocabulary, loop depth (the engine's loop cap),
    context length (tokens); default_min_loops: a request's min_loops when it sets none
    (`resolve_min_loops`); default_loops: its max_loops when it sets none (the checkpoint's
    count, below `model_depth` under a larger cap; None: `model_depth`)."""

    vocab_size: int
    model_depth: int
    max_model_len: int
    default_min_loops: int = DEFAULT_GATE_MIN_LOOPS
    default_loops: int | None = None


def validate_request(
    request_id: object,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    limits: ModelLimits,
    kv: KVPort,
) -> tuple[tuple[int, ...], LoopBounds]:
    """The prompt as a tuple and the resolved loop bounds, or InvalidRequestError /
    CapacityError naming the offending field."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    prompt = tuple(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("prompt", "the prompt is empty")
    for token in prompt:
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not 0 <= token < limits.vocab_size
        ):
            raise InvalidRequestError(
                "prompt", f"token id {token!r} is not in the vocabulary [0, {limits.vocab_size})"
            )
    for token in sampling.stop_token_ids:
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequestError(
                "stop_token_ids",
                f"token id {token} is not in the vocabulary [0, {limits.vocab_size})",
            )
    for token in sampling.logit_bias or ():
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequestError(
                "logit_bias",
                f"token id {token} is not in the vocabulary [0, {limits.vocab_size})",
            )
    max_loops = sampling.resolve_max_loops(limits.model_depth, limits.default_loops)
    positions = len(prompt) + sampling.max_tokens - 1  # the last output is never fed back
    if positions > limits.max_model_len:
        raise CapacityError(
            "max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"context length {limits.max_model_len}",
        )
    needed = kv.blocks_for(positions)
    if needed > kv.num_blocks:
        raise CapacityError(
            "max_tokens",
            f"needs {needed} KV blocks but the pool has {kv.num_blocks}; shorten the prompt or "
            "max_tokens, or give the engine more KV blocks",
        )
    min_loops = sampling.resolve_min_loops(max_loops, limits.default_min_loops)
    return prompt, LoopBounds(min_loops, max_loops, sampling.exit_threshold)


def check_kv_transfer(kv_transfer: KVTransferParams | None, prompt_length: int) -> None:
    """A PD request's transfer parameters make sense for its prompt (InvalidRequestError)."""
    if kv_transfer is None:
        return
    if not kv_transfer.transfer_id:
        raise InvalidRequestError("kv_transfer_params.transfer_id", "must be a non-empty string")
    if kv_transfer.role is PDRole.PREFILL:
        target = kv_transfer.target
        if target is None:
            raise InvalidRequestError(
                "kv_transfer_params.target", "a prefill request needs the decode instance's target"
            )
        if target.prompt_length != prompt_length:
            raise InvalidRequestError(
                "kv_transfer_params.target",
                f"the target expects a {target.prompt_length}-token prompt, got {prompt_length}",
            )
        if not 0 <= target.first_token < prompt_length:
            raise InvalidRequestError(
                "kv_transfer_params.target",
                f"first_token {target.first_token} must be in [0, {prompt_length})",
            )
    elif kv_transfer.role is not PDRole.DECODE:
        raise InvalidRequestError(
            "kv_transfer_params.role", f"must be prefill or decode, got {kv_transfer.role!r}"
        )
