"""`KVReceiver`: D's side of the handoff. One `ReceiveTracker` per expected transfer, fed with
P's notifications; decides when D may activate a request, when it must fail it, and when the
destination blocks of a failed or cancelled transfer may be reused. Pure (no torch).

Used from the engine loop (one thread): `expect` once D admitted the request (its blocks and
hidden row reserved, the `HandoffTarget` reported), `poll` once per step, `cancel` on D's own
abort (client gone, shutdown of the request). The outcomes (COMPLETED, FAILED, RELEASED) are
README.md's "D: `KVReceiver`". Messages for unknown transfer ids, or from another agent than
the transfer's P, are stale and dropped; a message no P can send raises HandoffProtocolError
(as do the tracker's checks).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from rlt_contracts import ExecutionIdentity
from rlt_contracts.pd import HandoffTarget

from rlt_pd.messages import Cancel, Commit, Drained, Landed, PDTransportError, decode_message
from rlt_pd.receive import HandoffProtocolError, ReceiveTracker
from rlt_pd.transport_api import Transport

__all__ = ["KVReceiver", "ReceiveEvent", "ReceiveOutcome", "ReceiverConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverConfig:
    """wait_timeout_s: from `expect` to completion (P's prefill included).
    lease_s: from a cancel until the blocks are released without P's `drained`; longer than
        P's write lease (SenderConfig.write_timeout_s) so a write P gave up on cannot land in
        reused blocks."""

    wait_timeout_s: float = 600.0
    lease_s: float = 480.0

    def __post_init__(self) -> None:
        if self.wait_timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("wait_timeout_s and lease_s must be > 0")


class ReceiveOutcome(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"


class ReceiveEvent(NamedTuple):
    transfer_id: str
    outcome: ReceiveOutcome
    message: str = ""


@dataclass
class _Incoming:
    target: HandoffTarget
    peer: str
    tracker: ReceiveTracker
    deadline: float
    release_deadline: float | None = None  # set by cancel
    drained: bool = False  # P said: nothing pending or to come


class KVReceiver:
    """D's connector. Not thread-safe (the engine thread)."""

    def __init__(
        self,
        transport: Transport,
        config: ReceiverConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._config = config or ReceiverConfig()
        self._clock = clock
        self._transfers: dict[str, _Incoming] = {}

    @property
    def config(self) -> ReceiverConfig:
        return self._config

    @property
    def transfers(self) -> tuple[str, ...]:
        """Transfer ids not yet COMPLETED or RELEASED."""
        return tuple(self._transfers)

    def tracker(self, transfer_id: str) -> ReceiveTracker | None:
        state = self._transfers.get(transfer_id)
        return None if state is None else state.tracker

    def expect(self, target: HandoffTarget, prefill_agent: str) -> None:
        """Start waiting for `target.transfer_id`'s KV from `prefill_agent` (P's agent name)."""
        tid = target.transfer_id
        if tid in self._transfers:
            raise ValueError(f"transfer {tid!r} is already expected")
        self._transfers[tid] = _Incoming(
            target,
            prefill_agent,
            ReceiveTracker(ExecutionIdentity(tid, 0)),
            self._clock() + self._config.wait_timeout_s,
        )

    def cancel(self, transfer_id: str) -> bool:
        """D's abort: the transfer never activates, P is told to stop; its blocks stay held
        until poll() reports RELEASED. Idempotent; False for an unknown id (already completed
        or released)."""
        state = self._transfers.get(transfer_id)
        if state is None:
            return False
        self._cancel(state)
        return True

    def poll(self) -> list[ReceiveEvent]:
        """Feed notifications to the trackers and report outcomes (see the module docstring)."""
        for peer, raw in self._transport.notifications():
            self._on_message(peer, raw)
        now = self._clock()
        events: list[ReceiveEvent] = []
        for tid, state in list(self._transfers.items()):
            tracker = state.tracker
            if tracker.complete:
                events.append(ReceiveEvent(tid, ReceiveOutcome.COMPLETED))
                del self._transfers[tid]
                continue
            if not tracker.cancelled:
                if state.drained:
                    tracker.cancel()
                    events.append(
                        ReceiveEvent(
                            tid,
                            ReceiveOutcome.FAILED,
                            f"prefill side {state.peer!r} aborted the transfer "
                            f"({_progress(tracker)})",
                        )
                    )
                elif now >= state.deadline:
                    self._cancel(state)
                    events.append(
                        ReceiveEvent(
                            tid,
                            ReceiveOutcome.FAILED,
                            f"no KV from {state.peer!r} within {self._config.wait_timeout_s:g} s "
                            f"({_progress(tracker)})",
                        )
                    )
                    continue
                else:
                    continue
            if tracker.safe_to_release:
                events.append(ReceiveEvent(tid, ReceiveOutcome.RELEASED, "prefill side drained"))
                del self._transfers[tid]
            elif state.release_deadline is not None and now >= state.release_deadline:
                events.append(
                    ReceiveEvent(
                        tid,
                        ReceiveOutcome.RELEASED,
                        f"lease of {self._config.lease_s:g} s expired without drained from "
                        f"{state.peer!r}",
                    )
                )
                del self._transfers[tid]
        return events

    def _on_message(self, peer: str, raw: bytes) -> None:
        message = decode_message(raw)
        if isinstance(message, Cancel):
            raise HandoffProtocolError(f"decode side got {message!r} from {peer!r}")
        state = self._transfers.get(message.transfer_id)
        if state is None or state.peer != peer:
            return  # stale: finished, released, never expected here, or another P
        identity = state.tracker.identity
        if isinstance(message, Landed):
            state.tracker.record(identity, message.sequence)
        elif isinstance(message, Commit):
            state.tracker.commit(identity, message.count)
        elif isinstance(message, Drained):
            state.tracker.confirm_drained(identity)
            state.drained = True

    def _cancel(self, state: _Incoming) -> None:
        if state.tracker.cancelled:
            return
        state.tracker.cancel()
        state.release_deadline = self._clock() + self._config.lease_s
        try:
            self._transport.send(state.peer, Cancel(state.target.transfer_id))
        except PDTransportError as error:  # the lease still bounds the wait
            tid = state.target.transfer_id
            log.warning("could not send cancel of %s to %s: %s", tid, state.peer, error)


def _progress(tracker: ReceiveTracker) -> str:
    count = tracker.commit_count
    return f"{tracker.arrived_count} of {'?' if count is None else count} partitions arrived"
