"""PD handoff stages: the scheduler's side of prefill/decode disaggregation (R20).

Decode instance: an admitted request whose prompt KV comes from a prefill instance waits in
`AWAITING_KV` (`PDHandoffs.await_kv`; the engine collects it via `take_reserved` to tell the
prefill side where to write); once every write landed it starts in the next step: token 0 is
sampled there and the row decodes in the step's ticks (`start_remote_decode`).

Prefill instance: a request computes its prompt only; the chunk that completes it moves it to
`SENDING_KV` until every write to the decode instance completed.

A request that ends while a transfer may still touch its blocks and row (`holds_blocks_after`)
is held (`PDHandoffs.hold`) instead of freed, until the engine reports the transfer drained
(`PDHandoffs.release`). Requests at either endpoint of a transfer are never preemption victims
(`transfer_endpoints`).
"""

from __future__ import annotations

from collections.abc import Iterable

from rlt_contracts import ExecutionIdentity, FinishReason, KVPort, RequestStage

from rlt_scheduler.constrained import send_token0_mask
from rlt_scheduler.request_state import ScheduledRequest
from rlt_scheduler.step_builder import StepBuilder

_TRANSFER_STAGES = (RequestStage.AWAITING_KV, RequestStage.SENDING_KV)


class PDHandoffs:
    """Owns the PD requests outside the scheduler's queues: finished requests whose blocks a
    transfer may still touch (held: they count against runner slots until released), and
    decode requests admitted since the engine last asked (their KV target is now known)."""

    def __init__(self) -> None:
        self._held: dict[ExecutionIdentity, ScheduledRequest] = {}
        self._reserved: list[ScheduledRequest] = []

    @property
    def num_held(self) -> int:
        return len(self._held)

    def held_identities(self) -> frozenset[ExecutionIdentity]:
        return frozenset(self._held)

    def hold(self, request: ScheduledRequest) -> None:
        """Keep a finished request's blocks and row until its transfer drained."""
        self._held[request.identity] = request

    def release(self, identity: ExecutionIdentity) -> bool:
        """Stop holding `identity`; True if it was held (the caller frees its blocks and row)."""
        return self._held.pop(identity, None) is not None

    def await_kv(self, request: ScheduledRequest) -> None:
        """PD decode: a just-admitted request waits for its prompt's KV from a prefill
        instance; it is reported once by `take_reserved`."""
        request.stage = RequestStage.AWAITING_KV
        self._reserved.append(request)

    def take_reserved(self) -> list[ScheduledRequest]:
        """PD decode requests admitted since the last call (their KV target is now known)."""
        reserved, self._reserved = self._reserved, []
        return reserved


def holds_blocks_after(request: ScheduledRequest, reason: FinishReason) -> bool:
    """Whether a transfer may still use the request's blocks and row once it ends for `reason`
    (read before its stage becomes FINISHED): writes may still land on the decode side
    (AWAITING_KV), and a prefill-side transfer may still read them unless it ended because
    every write completed (i.e. unless the reason is not ABORT)."""
    return request.stage is RequestStage.AWAITING_KV or (
        request.prefill_only
        and request.stage in (RequestStage.PREFILL, RequestStage.SENDING_KV)
        and reason is FinishReason.ABORT
    )


def transfer_endpoints(running: Iterable[ScheduledRequest]) -> set[ExecutionIdentity]:
    """Requests whose blocks a KV transfer reads or writes: never preemption victims."""
    return {r.identity for r in running if r.stage in _TRANSFER_STAGES}


def start_remote_decode(
    request: ScheduledRequest, kv: KVPort, step: StepBuilder, output_bound: int
) -> None:
    """PD decode: the prompt's KV and final state landed and the request's blocks cover
    `output_bound` outputs; token 0 is sampled in this step and the row decodes in its ticks,
    as after a prompt completed here. The landed prompt is published for prefix reuse."""
    request.stage = RequestStage.DECODING
    request.kv_landed = False
    request.scheduled_prompt_tokens = request.computed_prompt_tokens = request.prompt_length
    kv.publish_prefix(request.identity, request.prompt_token_ids, request.prompt_length)
    step.add_remote_start(request.identity, output_bound)
    send_token0_mask(request, step)
