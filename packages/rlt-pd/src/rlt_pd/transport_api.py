"""What the connectors (sender.py, receiver.py) need from a transport: `KVTransport` (NIXL,
transport.py) implements it, and the unit tests use a scripted fake. Pure (no torch)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from rlt_pd.handoff import TransferPartition
from rlt_pd.messages import ControlMessage
from rlt_pd.region import KVRegion

__all__ = ["Transport", "TransportPoll"]


class TransportPoll(NamedTuple):
    """Writes that finished since the last poll, by the handle `Transport.write` returned.

    completed: the write finished locally (NIXL DONE): the *sender* may reuse its source bytes.
        This is not evidence that the bytes landed on the target; the notification is.
    failed: (handle, reason): the write failed or was aborted; its bytes may or may not have
        landed (partially). Nothing of it is still in flight.
    """

    completed: list[int]
    failed: list[tuple[int, str]]


class Transport(Protocol):
    """One engine's endpoint. Not thread-safe: one owner thread (the engine loop)."""

    @property
    def name(self) -> str: ...

    @property
    def region(self) -> KVRegion:
        """Local K/V geometry (plans use it as the source region)."""
        ...

    @property
    def hidden_state_bytes(self) -> int: ...

    def peer_region(self, peer: str) -> KVRegion:
        """A connected peer's K/V geometry (the destination region). Raises PDTransportError for
        a peer that is not connected."""
        ...

    def is_connected(self, peer: str) -> bool: ...

    def write(
        self,
        peer: str,
        partition: TransferPartition,
        notification: ControlMessage,
        *,
        hidden_rows: tuple[int, int] | None = None,
    ) -> int:
        """Post one partition as one WRITE to `peer` with `notification` (delivered to the peer
        after the partition's bytes landed). hidden_rows = (local row, peer row) for a partition
        with `hidden_state_bytes`. Returns a handle reported by `poll()` exactly once. Transport
        errors never raise here: they come back as a failed handle. Raises ValueError for a
        partition outside the registered memory (a caller bug)."""
        ...

    def send(self, peer: str, message: ControlMessage) -> None:
        """Send a control message. Raises PDTransportError when it cannot be sent."""
        ...

    def poll(self) -> TransportPoll: ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, raw message) pairs received since the last call, in arrival order per
        peer; decode with `rlt_pd.messages.decode_message`."""
        ...
