"""D-side receive state of one handoff: which partitions arrived, when D may activate
(`complete`: the commit and every partition it counts, not cancelled) and when cancelled
destination pages may be released (`safe_to_release`: cancelled and P confirmed drained);
README.md, "Planning", Evidence and Identity.

A message for another identity (a request id reused after cancellation, R17) is reported
STALE and changes nothing; one no correct sender can produce raises `HandoffProtocolError`.
"""

from __future__ import annotations

import enum

from rlt_contracts import ExecutionIdentity, RltError


class HandoffProtocolError(RltError, RuntimeError):
    """The sender broke the handoff protocol (sequence out of range, conflicting commit)."""


class Delivery(enum.StrEnum):
    """What an inbound message did to the tracker."""

    ACCEPTED = "accepted"  # new information recorded
    DUPLICATE = "duplicate"  # already known; nothing changed
    STALE = "stale"  # for a different admission; dropped, nothing changed


class ReceiveTracker:
    """Receive-wait state of one admission on D. Owned by D's scheduler-side connector; nothing
    else mutates it. Not thread-safe (one owner thread)."""

    __slots__ = ("_identity", "_arrived", "_commit_count", "_cancelled", "_drained")

    def __init__(self, identity: ExecutionIdentity) -> None:
        self._identity = identity
        self._arrived: set[int] = set()
        self._commit_count: int | None = None
        self._cancelled = False
        self._drained = False

    @property
    def identity(self) -> ExecutionIdentity:
        return self._identity

    @property
    def commit_count(self) -> int | None:
        """Partitions P posted, once commit arrived; None before."""
        return self._commit_count

    @property
    def arrived_count(self) -> int:
        """Distinct sequence numbers received so far."""
        return len(self._arrived)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def complete(self) -> bool:
        """D may activate: committed, every partition arrived, and not cancelled."""
        return (
            not self._cancelled
            and self._commit_count is not None
            and len(self._arrived) == self._commit_count
        )

    @property
    def safe_to_release(self) -> bool:
        """Cancelled destination pages may be reused: cancelled and the sender drained."""
        return self._cancelled and self._drained

    def missing(self) -> tuple[int, ...] | None:
        """Sequence numbers still awaited (ascending), or None while the count is unknown."""
        if self._commit_count is None:
            return None
        return tuple(s for s in range(self._commit_count) if s not in self._arrived)

    def record(self, identity: ExecutionIdentity, sequence: int) -> Delivery:
        """A write notification for partition `sequence` arrived (its bytes have landed).

        Accepted in any order, before or after commit, and after cancel (writes still land;
        they just never activate). Raises HandoffProtocolError for a negative sequence or one
        >= the committed count.
        """
        if identity != self._identity:
            return Delivery.STALE
        if sequence < 0 or (self._commit_count is not None and sequence >= self._commit_count):
            raise HandoffProtocolError(
                f"{self._identity}: sequence {sequence} outside [0, {self._commit_count})"
            )
        if sequence in self._arrived:
            return Delivery.DUPLICATE
        self._arrived.add(sequence)
        return Delivery.ACCEPTED

    def commit(self, identity: ExecutionIdentity, count: int) -> Delivery:
        """P posted all `count` partitions (some may still be in flight).

        A repeated commit with the same count is a DUPLICATE. Raises HandoffProtocolError for
        count < 1 (every plan has a partition carrying the hidden state), a different count than
        an earlier commit, or a count that excludes a sequence number already received.
        """
        if identity != self._identity:
            return Delivery.STALE
        if self._commit_count is not None:
            if count != self._commit_count:
                raise HandoffProtocolError(
                    f"{self._identity}: commit({count}) after commit({self._commit_count})"
                )
            return Delivery.DUPLICATE
        if count < 1:
            raise HandoffProtocolError(f"{self._identity}: commit({count}); count must be >= 1")
        beyond = sorted(s for s in self._arrived if s >= count)
        if beyond:
            raise HandoffProtocolError(
                f"{self._identity}: commit({count}) but sequences {beyond} already arrived"
            )
        self._commit_count = count
        return Delivery.ACCEPTED

    def confirm_drained(self, identity: ExecutionIdentity) -> Delivery:
        """The sender (or the coordinator, if P never started) guarantees that no write into this
        allocation is pending or can start. May arrive before or after cancel()."""
        if identity != self._identity:
            return Delivery.STALE
        if self._drained:
            return Delivery.DUPLICATE
        self._drained = True
        return Delivery.ACCEPTED

    def cancel(self) -> None:
        """Stop waiting: the admission will never activate. Its destination pages stay held
        until `safe_to_release` (P may still be writing into them). Idempotent."""
        self._cancelled = True
