"""How many decode ticks a step runs, and how many outputs they can produce (KV lookahead).

A tick runs one loop for every decoding row on the device, where exits, sampling and stops
happen without the host; the scheduler only chooses how many ticks a step holds and must size
every decoding request's blocks for the most outputs those ticks can make.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlt_contracts import ExecutionIdentity, RequestStage, SchedulerConfig, SchedulingMode

from rlt_scheduler.request_state import ScheduledRequest


def decode_ticks(
    config: SchedulerConfig,
    running: Iterable[ScheduledRequest],
    unconfirmed_ticks: Mapping[ExecutionIdentity, int],
    *,
    admission_possible: bool,
    model_depth: int,
) -> int:
    """Ticks for the next step. While prompts can be computed (a running request is in
    PREFILL, or `admission_possible`: a waiting request can start now) `prefill_step_ticks`:
    by default 1, so prefill keeps flowing and new requests start soon; with
    `prefill_step_decode_ticks` "auto" the model depth, so the decoding rows make about one
    token per prompt step instead of one loop (when served requests arrive a few ms apart,
    nearly every step carries a prompt chunk). Otherwise up to `decode_ticks_per_step`.
    In refill mode either is capped by the loops the longest request may still need beyond the
    submitted steps (a decoding row loops in every tick it takes part in, so ticks past that
    would only run padding). Requests that wait for KV blocks do not shorten the step: only a
    finish frees blocks, and one tick per step would multiply the host's per-step work while
    they wait."""
    running = list(running)
    if prompts_pending(running, admission_possible=admission_possible):
        ticks = config.prefill_step_ticks(model_depth)
    else:
        ticks = config.decode_ticks_per_step
    if config.mode is SchedulingMode.REFILL and ticks > 1:
        needed = max(
            (
                _loops_needed(r, unconfirmed_ticks)
                for r in running
                if r.stage is RequestStage.DECODING
            ),
            default=1,
        )
        ticks = min(ticks, max(needed, 1))
    return ticks


def prompts_pending(running: Iterable[ScheduledRequest], *, admission_possible: bool) -> bool:
    """The next step can compute prompt tokens: a waiting request can start now, or a running
    one is in PREFILL."""
    return admission_possible or any(r.stage is RequestStage.PREFILL for r in running)


def _loops_needed(
    request: ScheduledRequest, unconfirmed_ticks: Mapping[ExecutionIdentity, int]
) -> int:
    """Loops the request may still run beyond the submitted steps. A constrained request
    (structured output) makes one token per mask and holds in between, starting each token at
    loop 0: it needs max_loops when its next mask goes out now, else what its current mask's
    token may still need."""
    if request.constraint is not None:
        if not request.mask_sent:
            return request.bounds.max_loops
        return max(request.bounds.max_loops - request.mask_ticks, 0)
    return (
        (request.sampling.max_tokens - request.num_outputs) * request.bounds.max_loops
        - request.loops_into_token
        - unconfirmed_ticks.get(request.identity, 0)
    )


def tick_output_bound(request: ScheduledRequest, ticks: int, *, fresh: bool) -> int:
    """Most outputs `ticks` loop ticks can produce: one per `min_exit_depth` loops; a token
    already looping (`fresh` False: its loops so far are unknown here) may exit after one."""
    depth = request.rule.exit.min_exit_depth
    if fresh:
        return ticks // depth
    return 0 if ticks <= 0 else 1 + (ticks - 1) // depth
