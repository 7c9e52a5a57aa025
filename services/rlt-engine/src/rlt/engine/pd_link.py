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
(possibly later) frees what a write might still touch.
"""

from __future__ import annotations

from rlt_contracts import (
    ExecutionIdentity,
    HandoffTarget,
    KVHandoffPort,
    PDRole,
    RequestOutputDelta,
    SchedulerOutput,
)
from rlt_kv import KVCacheManager
from rlt_runner import ModelRunner
from rlt_scheduler import Scheduler


class PDLink:
    def __init__(
        self,
        role: PDRole,
        port: KVHandoffPort,
        scheduler: Scheduler,
        runner: ModelRunner,
        kv: KVCacheManager,
        *,
        agent_name: str,
    ) -> None:
        self.role = role
        self.port = port
        self.agent_name = agent_name
        self._scheduler = scheduler
        self._runner = runner
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
            if request.identity not in self._runner.rows:
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
                hidden_row=self._runner.rows.record(request.identity).row,
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

    def after_collect(self, scheduled: SchedulerOutput) -> None:
        """P: the step's device work is complete: send the prompt chunks it computed."""
        if self.role is not PDRole.PREFILL:
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
            final_row = (
                self._runner.rows.record(request.identity).row if chunk.completes_prompt else None
            )
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

    # -- bookkeeping -----------------------------------------------------------------------------
    def _track(self, transfer_id: str, identity: ExecutionIdentity) -> None:
        self._by_transfer[transfer_id] = identity
        self._transfer_of[identity] = transfer_id

    def _forget(self, transfer_id: str) -> ExecutionIdentity | None:
        identity = self._by_transfer.pop(transfer_id, None)
        if identity is not None:
            self._transfer_of.pop(identity, None)
        return identity
