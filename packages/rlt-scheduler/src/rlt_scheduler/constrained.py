"""Structured output: the scheduler's side of a request's grammar matcher (R02; README.md,
"Structured output: one token per mask"): the step that samples token 0 carries the first mask
(`send_token0_mask`), the next mask goes out only once the previous one's token is recorded
(`send_mask_if_due`, `accept_output`), and the output bound is what the current mask still
allows (`decode_output_bound`). Everything here reads or updates one request's mask
bookkeeping (`constraint`, `mask_sent`, `mask_ticks`) and appends to the step being built.
"""

from __future__ import annotations

from rlt_contracts import EngineRequest, InvalidRequestError, PDRole, TokenConstraint, TokenMask
from rlt_contracts.structured import ConstraintCompiler

from rlt_scheduler.decode_work import DecodeWork
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.step_builder import StepBuilder


def compile_constraint(
    request: EngineRequest, compiler: ConstraintCompiler | None
) -> TokenConstraint | None:
    """A fresh matcher for a structured-output request (none on a PD prefill instance,
    which samples nothing). Compile errors are InvalidRequestErrors naming the field; with no
    `compiler`, a structured-output request is rejected."""
    spec = request.sampling.structured_output
    if spec is None or (
        request.kv_transfer is not None and request.kv_transfer.role is PDRole.PREFILL
    ):
        return None
    if compiler is None:
        raise InvalidRequestError(spec.field, "structured output is not available here")
    return compiler.compile(spec)


def decode_output_bound(request: ScheduledRequest, work: DecodeWork) -> int:
    """Most outputs a decoding request can make in a step whose decode is `work`. A
    constrained request (structured output) makes one per token mask: one if this step brings
    the next mask; else one if its current mask's token may still come (no step in flight
    counts it), otherwise none (it is held on the device until its next mask)."""
    bound = work.output_bound(request, fresh=False)
    if request.constraint is None:
        return bound
    if not request.mask_sent:
        return min(bound, 1)
    return min(bound, max(1 - request.unconfirmed_tokens, 0))


def start_output_bound(request: ScheduledRequest, work: DecodeWork) -> int:
    """Outputs of the step that samples token 0: token 0 plus what its decode can make
    (nothing more for a constrained request: it holds until its next mask)."""
    if request.constraint is not None:
        return 1
    return 1 + work.output_bound(request, fresh=True)


def send_mask_if_due(request: ScheduledRequest, step: StepBuilder) -> None:
    """Structured output: once the previous output was read back and accepted (so no step
    in flight can sample for the request), send the next output's allowed-token bitmask.
    The device holds the row after each output until its next mask arrives."""
    if request.constraint is None or request.mask_sent:
        return
    step.token_masks.append(TokenMask(request.identity, request.constraint.allowed_token_bitmask()))
    request.mask_sent = True
    request.mask_ticks = 0


def send_token0_mask(request: ScheduledRequest, step: StepBuilder) -> None:
    """Structured output: token 0 is sampled in this step under the grammar's first mask
    (it is certain to come, so no loops are left to wait for: `mask_ticks` = max)."""
    if request.constraint is not None:
        send_mask_if_due(request, step)
        request.mask_ticks = request.bounds.max_loops


def count_mask_ticks(request: ScheduledRequest, work: DecodeWork) -> None:
    """A submitted step decodes a request: a constrained one counts the step's loops against
    its current mask (the loops it still needs are `max_loops - mask_ticks`)."""
    if request.constraint is not None:
        request.mask_ticks += work.mask_loops(request)


def accept_output(request: ScheduledRequest, token_id: int, index: int) -> str | None:
    """The matcher consumes the request's output `index` (its mask was used up, so the next one
    is due). Returns None if the grammar accepts it, else the error to abort the
    request with: a token the grammar rejects cannot come from a masked row, so the request is
    not continued off the grammar. Requires `request.constraint`."""
    request.mask_sent = False
    if request.constraint.accept_token(token_id):
        return None
    return f"token {token_id} (output {index}) violates the grammar"


def grammar_terminated(request: ScheduledRequest) -> bool:
    """The request's grammar is complete (it finishes with "stop", vLLM's rule)."""
    return request.constraint is not None and request.constraint.is_terminated()
