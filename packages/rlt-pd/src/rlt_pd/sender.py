"""`KVSender`: P's worker-side connector. Pushes each prefill chunk's KV into D's blocks as
numbered partitions, then the hidden state and the commit; paces writes by in-flight bytes;
reports per transfer when P may free its blocks. Pure (no torch): it drives a `Transport`.
Driven from the engine loop (one thread); README.md, "P: `KVSender`", gives the calls, the
in-flight bound, the outcomes, `drained` and the tombstones.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from rlt_contracts import ExecutionIdentity
from rlt_contracts.pd import HandoffTarget

from rlt_pd.handoff import (
    DEFAULT_MAX_TRANSFER_DESCRIPTORS,
    DEFAULT_TRANSFER_CHUNK_BYTES,
    TransferPartition,
    plan_handoff,
)
from rlt_pd.messages import (
    Cancel,
    Commit,
    Drained,
    Landed,
    PDTransportError,
    decode_message,
)
from rlt_pd.receive import HandoffProtocolError
from rlt_pd.region import KVRegion
from rlt_pd.transport_api import Transport

__all__ = ["KVSender", "SendEvent", "SendOutcome", "SenderConfig"]

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024  # PDConfig.max_inflight_bytes (vllm-rlt's limit)


@dataclass(frozen=True)
class SenderConfig:
    """max_inflight_bytes: bytes of posted, unfinished writes (engine-wide); later partitions
        wait in a FIFO. One partition is always allowed when nothing is in flight.
    transfer_chunk_bytes / max_descriptors: per-partition limits (plan_handoff).
    write_timeout_s: lease of one posted write; past it the transfer fails.
    tombstone_s: how long cancelled and finished transfer ids are remembered."""

    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    transfer_chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES
    max_descriptors: int = DEFAULT_MAX_TRANSFER_DESCRIPTORS
    write_timeout_s: float = 300.0
    tombstone_s: float = 900.0

    def __post_init__(self) -> None:
        if self.transfer_chunk_bytes < 1 or self.max_descriptors < 1:
            raise ValueError("transfer_chunk_bytes and max_descriptors must be >= 1")
        if self.max_inflight_bytes < self.transfer_chunk_bytes:
            raise ValueError(
                f"max_inflight_bytes {self.max_inflight_bytes} < transfer_chunk_bytes "
                f"{self.transfer_chunk_bytes}: a full partition could never be posted"
            )
        if self.write_timeout_s <= 0 or self.tombstone_s <= 0:
            raise ValueError("write_timeout_s and tombstone_s must be > 0")


class SendOutcome(enum.StrEnum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class SendEvent(NamedTuple):
    transfer_id: str
    outcome: SendOutcome
    message: str = ""


@dataclass
class _Outgoing:
    target: HandoffTarget
    identity: ExecutionIdentity
    peer_region: KVRegion  # D's geometry, taken at start
    next_position: int = 0  # first position not sent yet (starts at target.first_token)
    next_sequence: int = 0
    final_planned: bool = False
    commit_sent: bool = False
    inflight: dict[int, tuple[int, float]] = field(default_factory=dict)  # handle: (bytes, t)
    cancelled: bool = False
    failure: str | None = None
    write_expired: bool = False

    @property
    def peer(self) -> str:
        return self.target.decode_agent

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.failure is not None


@dataclass
class _Entry:
    """A queued partition (or, with partition None, the transfer's commit)."""

    state: _Outgoing
    partition: TransferPartition | None
    ready: Callable[[], bool] | None = None
    hidden_rows: tuple[int, int] | None = None


class KVSender:
    """P's connector. Not thread-safe (the engine thread)."""

    def __init__(
        self,
        transport: Transport,
        config: SenderConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._config = config or SenderConfig()
        self._clock = clock
        self._transfers: dict[str, _Outgoing] = {}
        self._queue: list[_Entry] = []
        self._handles: dict[int, _Outgoing] = {}
        self._inflight_bytes = 0
        self._tombstones: dict[str, float] = {}  # transfer id -> forget after

    # -- state ---------------------------------------------------------------------------------

    @property
    def config(self) -> SenderConfig:
        return self._config

    @property
    def inflight_bytes(self) -> int:
        """Bytes of posted writes not yet reported finished."""
        return self._inflight_bytes

    @property
    def queued_partitions(self) -> int:
        return sum(1 for e in self._queue if e.partition is not None)

    @property
    def transfers(self) -> tuple[str, ...]:
        """Transfer ids not yet reported by poll()."""
        return tuple(self._transfers)

    # -- engine calls --------------------------------------------------------------------------

    def start(self, target: HandoffTarget) -> bool:
        """Register a transfer to `target` (PDTransportError if D is not connected, ValueError
        if its tables do not fit D's pool). False, registering nothing, for a transfer id
        cancelled before it started (D already released its blocks: abort the request)."""
        self._expire_tombstones()
        tid = target.transfer_id
        if tid in self._tombstones:
            return False
        if tid in self._transfers:
            raise ValueError(f"transfer {tid!r} already started")
        if not self._transport.is_connected(target.decode_agent):
            raise PDTransportError(
                f"transfer {tid!r}: decode agent {target.decode_agent!r} is not connected"
            )
        peer_region = self._transport.peer_region(target.decode_agent)
        _check_target(target, peer_region)
        self._transfers[tid] = _Outgoing(
            target, ExecutionIdentity(tid, 0), peer_region, next_position=target.first_token
        )
        return True

    def send_chunk(
        self,
        transfer_id: str,
        source_tables: Sequence[Sequence[int]],
        start: int,
        end: int,
        final_hidden_row: int | None = None,
        *,
        ready: Callable[[], bool] | None = None,
    ) -> bool:
        """Queue positions [start, end) of the prompt (P's block tables, one per plane) and post
        what the in-flight bound allows. Chunks leave no gap: `start` is at most the first
        position not sent yet (initially `target.first_token`); positions already sent are not
        sent again. The chunk ending at `prompt_length` is final and gives `final_hidden_row`
        (P's row, written to `target.hidden_row`); the commit follows its partitions.
        `ready`: polled before the chunk's partitions are posted (e.g. a CUDA event's `query`;
        None: the device work is complete). Returns False (queuing nothing) for a transfer
        that was cancelled, failed or already reported. README.md, "P: `KVSender`".
        """
        state = self._transfers.get(transfer_id)
        if state is None or state.stopped:
            if state is not None or transfer_id in self._tombstones:
                return False
            raise ValueError(f"transfer {transfer_id!r} was not started")
        target = state.target
        if state.final_planned:
            raise ValueError(f"transfer {transfer_id!r}: chunk after the final one")
        if start > state.next_position or not start <= end <= target.prompt_length:
            raise ValueError(
                f"transfer {transfer_id!r}: chunk [{start}, {end}) leaves a gap after position "
                f"{state.next_position} or exceeds prompt_length {target.prompt_length}"
            )
        final = end == target.prompt_length
        if final != (final_hidden_row is not None):
            raise ValueError(
                f"transfer {transfer_id!r}: final_hidden_row must be given exactly with the "
                f"final chunk (ending at {target.prompt_length}), got [{start}, {end})"
            )
        first = min(state.next_position, end)  # >= target.first_token
        plan = plan_handoff(
            state.identity,
            source_tables,
            target.block_tables,
            end,
            self._transport.region,
            hidden_state_bytes=self._transport.hidden_state_bytes,
            destination_region=state.peer_region,
            first_token=first,
            transfer_chunk_bytes=self._config.transfer_chunk_bytes,
            max_descriptors=self._config.max_descriptors,
            first_sequence=state.next_sequence,
            final=final,
        )
        state.next_position = max(state.next_position, end)
        state.next_sequence = plan.commit_count
        for partition in plan.partitions:
            rows = None
            if partition.hidden_state_bytes:
                assert final_hidden_row is not None
                rows = (final_hidden_row, target.hidden_row)
            self._queue.append(_Entry(state, partition, ready, rows))
        if final:
            state.final_planned = True
            self._queue.append(_Entry(state, None, ready))
        self._pump()
        return True

    def cancel(self, transfer_id: str) -> None:
        """P's own abort: post nothing more; once in-flight writes finished, D gets `drained`
        and poll() reports CANCELLED (or FAILED if a write failed first). Idempotent; an
        unknown id is remembered so that a later start() of it is refused."""
        state = self._transfers.get(transfer_id)
        if state is None:
            self._tombstone(transfer_id)
            return
        state.cancelled = True

    def poll(self) -> list[SendEvent]:
        """Handle D's cancels, collect finished writes, expire write leases, post queued
        partitions and report transfers whose blocks P may free. Raises HandoffProtocolError
        for a notification no D sends."""
        self._expire_tombstones()
        for peer, raw in self._transport.notifications():
            self._on_message(peer, raw)
        self._harvest()
        self._expire_writes()
        self._pump()
        return self._collect()

    # -- internals -----------------------------------------------------------------------------

    def _on_message(self, peer: str, raw: bytes) -> None:
        message = decode_message(raw)
        if not isinstance(message, Cancel):
            raise HandoffProtocolError(f"prefill side got {message!r} from {peer!r}")
        tid = message.transfer_id
        state = self._transfers.get(tid)
        if state is not None:
            if state.peer == peer:
                state.cancelled = True
            return  # another agent's cancel for this id is stale
        # Unknown or finished: nothing of it is in flight here, and the tombstone keeps it so.
        self._tombstone(tid)
        self._send(peer, Drained(tid))

    def _harvest(self) -> bool:
        """Account the writes the transport reports finished; True if there were any."""
        completed, failed = self._transport.poll()
        for handle in completed:
            self._finish_write(handle)
        for handle, reason in failed:
            state = self._finish_write(handle)
            if state is not None and state.failure is None:
                state.failure = reason
        return bool(completed or failed)

    def _finish_write(self, handle: int) -> _Outgoing | None:
        state = self._handles.pop(handle, None)
        if state is None:
            return None  # a write whose lease already expired
        size, _ = state.inflight.pop(handle)
        self._inflight_bytes -= size
        return state

    def _expire_writes(self) -> None:
        now = self._clock()
        limit = self._config.write_timeout_s
        for state in self._transfers.values():
            expired = [h for h, (_, posted) in state.inflight.items() if now - posted > limit]
            for handle in expired:
                self._finish_write(handle)
                state.write_expired = True
                if state.failure is None:
                    state.failure = f"a write did not complete within {limit:g} s"

    def _pump(self) -> None:
        """Post queued entries in FIFO order within the in-flight bound; per transfer in order
        (an entry waits behind its transfer's not-ready ones, the commit behind everything).
        When the bound stops a partition, the writes finished meanwhile are accounted first
        (`_harvest`), not only at the next `poll()` (README.md, "In-flight bound")."""
        limit = self._config.max_inflight_bytes

        def fits(size: int) -> bool:
            return not self._inflight_bytes or self._inflight_bytes + size <= limit

        remaining: list[_Entry] = []
        blocked: set[str] = set()
        full = False
        for entry in self._queue:
            state = entry.state
            tid = state.target.transfer_id
            if state.stopped:
                continue  # dropped
            if tid in blocked or not self._ready(entry):
                blocked.add(tid)
                remaining.append(entry)
                continue
            if entry.partition is None:
                self._commit(state)  # everything of this transfer before it is posted
                continue
            size = entry.partition.total_bytes
            while not full and not fits(size) and self._harvest():
                pass  # finished writes made room (or failed a transfer: checked below)
            if state.stopped:
                continue  # a write of this transfer failed meanwhile: dropped
            if full or not fits(size):
                full = True  # FIFO: no partition overtakes one waiting for room
                blocked.add(tid)
                remaining.append(entry)
                continue
            try:
                handle = self._transport.write(
                    state.peer,
                    entry.partition,
                    Landed(tid, entry.partition.sequence),
                    hidden_rows=entry.hidden_rows,
                )
            except ValueError as error:  # e.g. a hidden row D does not have
                state.failure = f"partition {entry.partition.sequence} refused: {error}"
                continue
            state.inflight[handle] = (size, self._clock())
            self._handles[handle] = state
            self._inflight_bytes += size
        self._queue = remaining

    def _ready(self, entry: _Entry) -> bool:
        if entry.ready is None:
            return True
        try:
            ready = bool(entry.ready())
        except Exception as error:  # e.g. a CUDA error surfacing through the event
            entry.state.failure = f"chunk readiness check failed: {error!r}"
            return False
        if ready:
            entry.ready = None
        return ready

    def _commit(self, state: _Outgoing) -> None:
        tid = state.target.transfer_id
        try:
            self._transport.send(state.peer, Commit(tid, state.next_sequence))
        except PDTransportError as error:
            state.failure = f"commit could not be sent: {error}"
            return
        state.commit_sent = True

    def _collect(self) -> list[SendEvent]:
        events = []
        for tid, state in list(self._transfers.items()):
            if state.inflight and not state.write_expired:
                continue
            if state.stopped:
                if not state.write_expired:
                    self._send(state.peer, Drained(tid))
                if state.failure is not None:
                    events.append(SendEvent(tid, SendOutcome.FAILED, state.failure))
                else:
                    events.append(SendEvent(tid, SendOutcome.CANCELLED))
            elif state.commit_sent:
                events.append(SendEvent(tid, SendOutcome.DONE))
            else:
                continue
            for handle in list(state.inflight):  # after a lease expiry: stop accounting them
                self._finish_write(handle)
            del self._transfers[tid]
            self._tombstone(tid)
        return events

    def _send(self, peer: str, message: Cancel | Drained) -> None:
        try:
            self._transport.send(peer, message)
        except PDTransportError as error:  # D then relies on its lease
            log.warning("could not send %r to %s: %s", message, peer, error)

    def _tombstone(self, transfer_id: str) -> None:
        self._tombstones[transfer_id] = self._clock() + self._config.tombstone_s

    def _expire_tombstones(self) -> None:
        now = self._clock()
        for tid in [t for t, until in self._tombstones.items() if until <= now]:
            del self._tombstones[tid]


def _check_target(target: HandoffTarget, region: KVRegion) -> None:
    """D's tables must cover the prompt with distinct blocks of D's pool (checked once here, so
    chunks cannot fail on them later)."""
    tid = target.transfer_id
    if not 0 <= target.first_token <= target.prompt_length:
        raise ValueError(f"transfer {tid!r}: first_token outside [0, prompt_length]")
    if not target.block_tables:
        raise ValueError(f"transfer {tid!r}: no destination block tables")
    if target.hidden_row < 0:
        raise ValueError(f"transfer {tid!r}: hidden_row {target.hidden_row} < 0")
    pages = -(-target.prompt_length // region.block_size)
    first_page = target.first_token // region.block_size
    seen: set[int] = set()
    for plane, table in enumerate(target.block_tables):
        if len(table) < pages:
            raise ValueError(
                f"transfer {tid!r}: plane {plane} has {len(table)} destination pages, "
                f"{pages} needed for {target.prompt_length} tokens"
            )
        for block in table[first_page:pages]:
            if not 0 <= block < (region.num_blocks or block + 1) or block in seen:
                raise ValueError(
                    f"transfer {tid!r}: destination block {block} of plane {plane} is outside "
                    f"D's pool of {region.num_blocks} or used twice"
                )
            seen.add(block)
