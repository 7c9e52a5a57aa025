"""Applying a step's results to request progress: prompt progress and generated tokens.

Prompt progress is completion evidence for a chunk of that very step (R18): it advances
`computed_prompt_tokens` and publishes the prefix. Generated tokens must start at the next
expected output index; the scheduler re-applies stop ids, the grammar and `max_tokens` and
stays authoritative: tokens after the finishing one are discarded. Recording order per token:
the grammar accepts it, then stop ids, then grammar termination, then `max_tokens`.

These functions update one request's progress and the counters; the decision to finish is
returned (`FinishDecision`) for the scheduler's one cleanup path (`Scheduler._finish`, R16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlt_contracts import (
    ExecutionIdentity,
    FinishReason,
    GeneratedTokens,
    KVPort,
    ModelRunnerOutput,
    PrefillProgress,
    PromptLogprobs,
    RequestStage,
    SchedulerOutput,
)

from rlt_scheduler import scored_prefix
from rlt_scheduler.constrained import accept_output, grammar_terminated
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.stats import SchedulerStats


@dataclass(frozen=True)
class FinishDecision:
    """Recording a token ended the request: with `reason`, and `error` for an abort."""

    reason: FinishReason
    error: str | None = None


def check_progress_evidence(step: SchedulerOutput, result: ModelRunnerOutput) -> None:
    """Prompt progress is completion evidence for a chunk of that very step (R18): progress
    for any other range, or from a step that failed as a whole, is a runner bug."""
    chunks = {(c.identity, c.end_position) for c in step.prefill}
    for progress in result.prefill_progress:
        if result.step_failed or (progress.identity, progress.end_position) not in chunks:
            raise RuntimeError(
                f"step {result.step_id} reports prompt progress {progress} that none of its "
                "completed chunks establishes"
            )


def apply_prefill_progress(
    request: ScheduledRequest, progress: PrefillProgress, kv: KVPort, stats: SchedulerStats
) -> None:
    """The prompt is computed up to `progress.end_position` (exclusive): count the positions
    and, unless the request was preempted meanwhile, publish them for prefix reuse (a scored
    prompt's with their scores, recorded first; an exit-depth one's under its rule's salt:
    scored_prefix.py)."""
    stats.prompt_tokens += progress.end_position - request.computed_prompt_tokens
    request.computed_prompt_tokens = progress.end_position
    if request.stage is not RequestStage.WAITING:
        scored_prefix.publish(kv, request, progress.end_position)


def record_prompt_logprobs(request: ScheduledRequest, scores: PromptLogprobs) -> None:
    """Scored prompt tokens arrive chunk by chunk, in order (a gap is a runner bug), with their
    exit depths when the request scores at exit depth (missing depths are a runner bug)."""
    if scores.first_token != len(request.prompt_scores) + 1:
        raise RuntimeError(
            f"{request.identity}: prompt token {scores.first_token} scored, "
            f"{len(request.prompt_scores) + 1} expected next"
        )
    if request.sampling.score_at_exit_depth:
        if len(scores.exit_depths) != len(scores.token_logprobs):
            raise RuntimeError(
                f"{request.identity}: {len(scores.token_logprobs)} prompt tokens scored at "
                f"exit depth with {len(scores.exit_depths)} depths"
            )
        request.prompt_exit_depths.extend(scores.exit_depths)
    request.prompt_scores.extend(
        zip(scores.token_logprobs, scores.token_ranks, scores.top_logprobs, strict=True)
    )


def check_output_index(request: ScheduledRequest, generated: GeneratedTokens) -> None:
    """Generated tokens must start at the next expected output (a gap is a runner bug)."""
    if generated.first_output_index != request.num_outputs:
        raise RuntimeError(
            f"{request.identity}: output {generated.first_output_index} reported, "
            f"{request.num_outputs} expected next"
        )


def record_generated(
    request: ScheduledRequest, generated: GeneratedTokens, now: float, stats: SchedulerStats
) -> FinishDecision | None:
    """Append the tokens (every per-token column) of `generated` up to the first one that ends
    the request, and stamp the token times with `now` (host monotonic seconds). Returns how the
    request ends, or None while it continues; the caller finishes it."""
    token_ids = generated.token_ids
    if not token_ids:
        return None
    if request.first_token_time is None:
        request.first_token_time = now
    request.last_token_time = now
    start, end, decision = request.num_outputs, len(token_ids), None
    for i, token in enumerate(token_ids):
        if request.constraint is not None:
            error = accept_output(request, token, start + i)
            if error is not None:
                end, decision = i + 1, FinishDecision(FinishReason.ABORT, error)
                break
        reason = finish_reason(request, token, start + i + 1)
        if reason is not None:
            end, decision = i + 1, FinishDecision(reason)
            break
    request.outputs.extend(generated, 0, end)
    stats.generation_tokens += end
    decoded = generated.exit_depths[max(0, 1 - start) : end]  # not token 0 (the prefill's)
    stats.decode_loops += sum(decoded)
    stats.decoded_tokens += len(decoded)
    # a token never loops past its rule's max_loops: the others exited early (C-speed count)
    stats.early_exit_tokens += len(decoded) - decoded.count(request.rule.exit.max_loops)
    return decision


def finish_reason(request: ScheduledRequest, token_id: int, outputs: int) -> FinishReason | None:
    """Why recording `token_id` as the request's `outputs`-th output ends it, or None."""
    if token_id in request.rule.stop_token_ids:
        return FinishReason.STOP
    if grammar_terminated(request):
        return FinishReason.STOP  # the grammar is complete (vLLM's rule)
    if outputs >= request.sampling.max_tokens:
        return FinishReason.LENGTH
    return None


def end_tokens_between_rounds(
    identities: Iterable[ExecutionIdentity],
    live: Callable[[ExecutionIdentity], ScheduledRequest | None],
) -> None:
    """A speculative step's rows end it between tokens: no loop of a next token has run, so
    the confirmed ticks are re-based to make `loops_into_token` 0 (ticks count loops only in
    tick steps)."""
    for identity in identities:
        request = live(identity)
        if request is not None:
            request.confirmed_ticks = sum(request.exit_depths[1:])
