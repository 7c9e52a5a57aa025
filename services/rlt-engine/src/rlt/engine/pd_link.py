"""`PDLink`: connects one engine core to a KV handoff port for its PD role (M9 wiring).

The scheduler owns request progression (AWAITING_KV / SENDING_KV stages); the port moves bytes
and reports evidence; the link translates between them on the engine thread, once per step:

    decode (D)   admitted remote request -> HandoffTarget (D's blocks, row) -> port.expect, and
                 the target goes out on the request's first delta; landed -> scheduler.kv_landed
                 (token 0 in the next step); failed -> the request is aborted, its blocks held;
                 released -> scheduler.release_held; a request aborted while awaiting KV ->
                 port.cancel (P drains, then D releases).
    prefill (P)  after a step's results are in (its device work is complete), every prompt
                 chunk of a prefill-only request is sent; the last one with the row holding the
                 final state; sent -> scheduler.kv_sent (the request ends, blocks freed);
                 failed -> aborted, blocks held; aborted while sending -> port.cancel.
    both         released (the port says nothing is in flight any more) -> release_held.
A port reports `failed` and `released` separately: failure ends the request at once, release
(possibly later) frees what a write might still touch. The link reads the runner only through
its `PDMemorySource` (which row holds a request's state); an engine without a PD role gets
`NoPD`, whose hooks do nothing, so the core's loop calls them unconditionally.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlt_contracts import (
    ExecutionIdentity,
    HandoffTarget,
    KVHandoffPort,
    ModelRunnerOutput,
    PDMemory,
    PDMemorySource,
    PDRole,
    RequestOutputDelta,
    SchedulerOutput,
)
from rlt_kv import KVCacheManager
from rlt_scheduler import Scheduler

# How long a PD instance's step waits when it has no model work, only transfers to watch.
PD_IDLE_POLL_S = 0.0005

# Makes a role's handoff port over the memory the runner declares (NIXL's unless given).
HandoffPortFactory = Callable[[PDRole, PDMemory], KVHandoffPort]


def _nothing(*_args) -> None:
    """A hook an engine without a PD role has nothing to do in."""


class NoPD:
    """The PD part of an engine that is neither a prefill nor a decode instance."""

    role = PDRole.NONE
    poll = after_collect = aborted = idle = close = _nothing  # PDLink's hooks, doing nothing

    def after_submit(self) -> list[RequestOutputDelta]:
        return []

    def live_failures(self, result: ModelRunnerOutput) -> list[ExecutionIdentity]:
        return []


class PDLink:
    def __init__(
        self,
        role: PDRole,
        port: KVHandoffPort,
        scheduler: Scheduler,
        rows: PDMemorySource,
        kv: KVCacheManager,
        *,
        agent_name: str,
    ) -> None:
        self.role = role
        self.port = port
        self.agent_name = agent_name
        self._scheduler = scheduler
        self._rows = rows
        self._kv = kv
        self._by_transfer: dict[str, ExecutionIdentity] = {}
        self._transfer_of: dict[ExecutionIdentity, str] = {}

    # -- per step --------------------------------------------------------------------------------
    def poll(self) -> None:
        """Apply the port's evidence to the scheduler (before scheduling the next step)."""
        events = self.port.poll()
        scheduler = self._scheduler
        for transfer_id in events.landed:
            identity = self._forget(transfer_id)
            if identity is not None:
                scheduler.kv_landed(identity)
        for transfer_id in events.sent:
            identity = self._forget(transfer_id)
            if identity is not None:
                scheduler.kv_sent(identity)
        for transfer_id, reason in events.failed:
            identity = self._by_transfer.get(transfer_id)
            if identity is not None:
                scheduler.kv_transfer_failed(identity, f"KV transfer failed: {reason}")
        for transfer_id in events.released:
            identity = self._forget(transfer_id)
            if identity is not None:
                scheduler.release_held(identity)

    def after_submit(self) -> list[RequestOutputDelta]:
        """D: the targets of requests admitted by the step just submitted (their rows are
        assigned now), registered with the port and returned as first deltas."""
        deltas = []
        for request in self._scheduler.newly_reserved():
            row = self._rows.hidden_row(request.identity)
            if row is None:
                # The step that admitted it failed and the runner dropped its row (R04): no
                # prefill instance ever learns this target, so nothing can write its blocks.
                message = "the step that admitted the request failed (see the engine log)"
                self._scheduler.kv_transfer_failed(request.identity, message)
                self._scheduler.release_held(request.identity)
                continue
            params = request.kv_transfer
            target = HandoffTarget(
                transfer_id=params.transfer_id,
                decode_agent=self.agent_name,
                block_tables=self._kv.block_tables(request.identity),
                first_token=request.computed_prompt_tokens,
                hidden_row=row,
                prompt_length=request.prompt_length,
            )
            self._track(params.transfer_id, request.identity)
            self.port.expect(target, params.prefill_agent or "")
            deltas.append(
                RequestOutputDelta(
                    request_id=request.identity.request_id,
                    token_ids=(),
                    exit_depths=(),
                    num_prompt_tokens=request.prompt_length,
                    kv_target=target,
                )
            )
        return deltas

    def live_failures(self, result: ModelRunnerOutput) -> list[ExecutionIdentity]:
        """Requests a result's failures will abort (named and still live): read before the
        scheduler applies the result."""
        named = [i for failure in result.failures for i in failure.identities]
        requests = [self._scheduler.get_request(i.request_id) for i in named]
        return [
            i
            for i, request in zip(named, requests, strict=True)
            if request is not None and request.identity == i and not request.finished
        ]

    def after_collect(
        self, scheduled: SchedulerOutput, step_failed: bool, failed: list[ExecutionIdentity]
    ) -> None:
        """After the scheduler applied a step's result: stop or release the transfers of the
        requests its failures aborted (`failed`, as `aborted`); P, unless the whole step
        failed: its device work is complete, send the prompt chunks it computed (skipping
        requests a failure aborted)."""
        for identity in failed:
            self.aborted(identity)
        if self.role is not PDRole.PREFILL or step_failed:
            return
        for chunk in scheduled.prefill:
            request = self._scheduler.get_request(chunk.identity.request_id)
            if (
                request is None
                or request.identity != chunk.identity
                or request.finished
                or not request.prefill_only
            ):
                continue
            target = request.kv_transfer.target
            start = max(chunk.start_position, target.first_token)
            if target.transfer_id not in self._by_transfer:
                # the first chunk sent starts at D's first missing position: it also carries
                # the positions P took from its own prefix cache (computed for an earlier
                # request, so no chunk of this one computes them)
                start = target.first_token
            if start >= chunk.end_position and not chunk.completes_prompt:
                continue  # positions D has cached already
            self._track(target.transfer_id, request.identity)
            final_row = self._rows.hidden_row(request.identity) if chunk.completes_prompt else None
            if chunk.completes_prompt and final_row is None:  # a live request keeps its row
                raise RuntimeError(f"{request.identity} computed its prompt and has no row")
            self.port.send_chunk(
                target,
                self._kv.block_tables(request.identity),
                min(start, chunk.end_position),
                chunk.end_position,
                final_row,
            )

    def aborted(self, identity: ExecutionIdentity) -> None:
        """A request ended outside the port's events (client gone, abort): stop its transfer;
        its held blocks are released once the port reports it drained (or at once if no
        transfer had started)."""
        transfer_id = self._transfer_of.get(identity)
        if transfer_id is not None:
            self.port.cancel(transfer_id)
        elif identity in self._scheduler.held_transfers():
            self._scheduler.release_held(identity)

    def idle(self) -> None:
        """A step with no model work and no delta: only transfers are pending (do not spin)."""
        time.sleep(PD_IDLE_POLL_S)

    def close(self) -> None:
        """Deregister the memory (before the runner drops it)."""
        self.port.close()

    # -- bookkeeping -----------------------------------------------------------------------------
    def _track(self, transfer_id: str, identity: ExecutionIdentity) -> None:
        self._by_transfer[transfer_id] = identity
        self._transfer_of[identity] = transfer_id

    def _forget(self, transfer_id: str) -> ExecutionIdentity | None:
        identity = self._by_transfer.pop(transfer_id, None)
        if identity is not None:
            self._transfer_of.pop(identity, None)
        return identity
