"""`TransportHandoffPort`: the `rlt_contracts.KVHandoffPort` an engine calls, over one
`Transport` (NIXL's `KVTransport` in production) and the connector of the engine's role:
`KVSender` on a prefill instance, `KVReceiver` on a decode instance. Pure (no torch).

It translates the connectors' outcomes into the engine's evidence (`HandoffEvents`):

    prefill (P)  DONE       -> sent                 (every write completed locally)
                 FAILED     -> failed + released    (nothing of it is in flight any more,
                 CANCELLED  -> failed + released     or its write lease expired)
    decode (D)   COMPLETED  -> landed               (every partition and the commit arrived)
                 FAILED     -> failed               (the blocks stay held ...)
                 RELEASED   -> released             (... until P drained or the lease expired)

Refusals that happen before anything was posted (a target D cancelled already, a peer that is
not connected, a target that does not fit) come back as failed + released on the next poll,
never as exceptions into the engine loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rlt_contracts.pd import HandoffEvents, HandoffTarget, PDRole

from rlt_pd.messages import PDTransportError
from rlt_pd.receiver import KVReceiver, ReceiveOutcome, ReceiverConfig
from rlt_pd.sender import KVSender, SenderConfig, SendOutcome
from rlt_pd.transport_api import Transport

__all__ = ["TransportHandoffPort"]

log = logging.getLogger(__name__)


class TransportHandoffPort:
    """One engine's handoff port. Not thread-safe: the engine thread is the only caller."""

    def __init__(
        self,
        role: PDRole,
        transport: Transport,
        *,
        sender_config: SenderConfig | None = None,
        receiver_config: ReceiverConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if role is PDRole.NONE:
            raise ValueError("a handoff port serves a prefill or a decode instance")
        self.role = role
        self.transport = transport
        self.sender = (
            KVSender(transport, sender_config, clock=clock) if role is PDRole.PREFILL else None
        )
        self.receiver = (
            KVReceiver(transport, receiver_config, clock=clock) if role is PDRole.DECODE else None
        )
        self._started: set[str] = set()  # P: transfers the sender knows
        self._refused: list[tuple[str, str]] = []  # failed before anything was posted
        self._stop_reasons: dict[str, str] = {}  # P: why a started transfer was stopped here

    # -- P ---------------------------------------------------------------------------------------
    def send_chunk(
        self,
        target: HandoffTarget,
        source_tables: tuple[tuple[int, ...], ...],
        start: int,
        end: int,
        final_hidden_row: int | None,
    ) -> None:
        sender = self._require(self.sender, "send_chunk")
        tid = target.transfer_id
        try:
            if tid not in self._started:
                if not sender.start(target):
                    self._refuse(tid, "the decode instance cancelled the transfer before it began")
                    return
                self._started.add(tid)
            sender.send_chunk(tid, source_tables, start, end, final_hidden_row)
        except (PDTransportError, ValueError) as error:
            if tid in self._started:  # stop it; poll() reports CANCELLED once drained
                sender.cancel(tid)
                self._stop_reasons[tid] = f"sending KV failed: {error}"
            else:
                self._refuse(tid, f"sending KV failed: {error}")

    # -- D ---------------------------------------------------------------------------------------
    def expect(self, target: HandoffTarget, prefill_agent: str) -> None:
        receiver = self._require(self.receiver, "expect")
        if not self.transport.is_connected(prefill_agent):
            # nothing can be written by an agent this transport does not know
            self._refuse(
                target.transfer_id, f"prefill agent {prefill_agent!r} is not connected here"
            )
            return
        receiver.expect(target, prefill_agent)

    # -- both ------------------------------------------------------------------------------------
    def cancel(self, transfer_id: str) -> None:
        if self.sender is not None:
            self.sender.cancel(transfer_id)
        elif self.receiver is not None:
            self.receiver.cancel(transfer_id)

    def poll(self) -> HandoffEvents:
        sent: list[str] = []
        landed: list[str] = []
        failed, self._refused = self._refused, []
        released = [tid for tid, _ in failed if tid not in self._started]
        if self.sender is not None:
            for event in self.sender.poll():
                self._started.discard(event.transfer_id)
                if event.outcome is SendOutcome.DONE:
                    sent.append(event.transfer_id)
                    continue
                reason = self._stop_reasons.pop(event.transfer_id, None) or (
                    event.message or "the decode instance cancelled the transfer"
                )
                failed.append((event.transfer_id, reason))
                released.append(event.transfer_id)
        if self.receiver is not None:
            for event in self.receiver.poll():
                if event.outcome is ReceiveOutcome.COMPLETED:
                    landed.append(event.transfer_id)
                elif event.outcome is ReceiveOutcome.FAILED:
                    failed.append((event.transfer_id, event.message))
                else:
                    released.append(event.transfer_id)
        return HandoffEvents(tuple(sent), tuple(landed), tuple(failed), tuple(released))

    @property
    def busy(self) -> bool:
        """Transfers are pending here (the engine keeps polling while it has no model work)."""
        if self._refused:
            return True
        if self.sender is not None:
            return bool(self.sender.transfers)
        return self.receiver is not None and bool(self.receiver.transfers)

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    # -- internals -------------------------------------------------------------------------------
    def _refuse(self, transfer_id: str, reason: str) -> None:
        log.warning("transfer %s refused: %s", transfer_id, reason)
        self._refused.append((transfer_id, reason))

    def _require(self, connector, call: str):
        if connector is None:
            raise PDTransportError(f"{call} is not a {self.role} instance's call")
        return connector
