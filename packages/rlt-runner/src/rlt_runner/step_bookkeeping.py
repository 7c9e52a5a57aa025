"""A step's bookkeeping and its failure protocol (R04): snapshots, releases, new and restored
rows, block-table growth and restores, in the contract's order, and what happens when one fails.

The scheduler decides (victims, admissions, releases); this module executes the decisions and
reports each outcome. README.md, "Failure protocol", says who each failure loses, what the rest
of the step does and how a lost identity's later work is skipped (`is_live`) until the
scheduler's release ends its tracking.
"""

from __future__ import annotations

import logging

from rlt_contracts import (
    ExecutionFailure,
    ExecutionIdentity,
    FailedOperation,
    SchedulerOutput,
    TokenMask,
)

from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_record import RowRecord
from rlt_runner.row_state import DecodeRows
from rlt_runner.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

# Errors a step (or one of its operations) may raise and the engine survives. CUDA's
# OutOfMemoryError is a RuntimeError; MemoryError covers host allocations.
RECOVERABLE_ERRORS = (RuntimeError, ValueError, MemoryError)


class StepBookkeeping:
    """Executes the state changes that precede a step's model work; owns the lost set."""

    def __init__(self, rows: DecodeRows, kv: KVStorage, snapshots: SnapshotStore) -> None:
        self.rows = rows
        self.kv = kv
        self.snapshots = snapshots
        self._lost: set[ExecutionIdentity] = set()

    def is_live(self, identity: ExecutionIdentity) -> bool:
        """False for a request whose device state was lost to a failure (work is skipped)."""
        return identity not in self._lost

    @property
    def lost(self) -> frozenset[ExecutionIdentity]:
        return frozenset(self._lost)

    def apply(self, step: SchedulerOutput) -> list[ExecutionFailure]:
        """Snapshots, releases, new and restored rows, block-table growth, restores, token masks
        (structured output). Returns the failures of single requests; a shared operation that
        fails raises (the step fails)."""
        failures = [self._save(identity) for identity in step.snapshots if self.is_live(identity)]
        self.rows.release(list(step.released))
        for identity in step.released:
            self.snapshots.discard(identity)
            self._lost.discard(identity)  # the scheduler is done with it
        restores = [i for i in step.restores if self.is_live(i)]
        new = [
            RowRecord(
                n.identity,
                -1,
                n.sampling,
                n.rule,
                n.prompt_length,
                prefill_only=n.prefill_only,
                prompt_token_ids=n.prompt_token_ids,
            )
            for n in step.new_requests
        ]
        self.rows.assign(new + [self.snapshots.record_of(i) for i in restores])
        self.rows.apply_block_updates(
            [(b.identity, b.updates) for b in step.block_updates if self.is_live(b.identity)]
        )
        failures += [self._restore(identity) for identity in restores]
        # structured output: next-token masks, after restores (a restore writes the saved mask)
        self.rows.apply_token_masks(
            [(self.rows.record(m.identity), m.words) for m in step.token_masks if self._has_row(m)]
        )
        return [f for f in failures if f is not None]

    def _has_row(self, mask: TokenMask) -> bool:
        return self.is_live(mask.identity) and mask.identity in self.rows

    def lose(self, identities: list[ExecutionIdentity]) -> None:
        """Drop the device state (row, snapshot) of requests named in a failure."""
        self._lost.update(identities)
        for identity in identities:
            self.snapshots.discard(identity)
        try:
            self.rows.release(identities)
        except RECOVERABLE_ERRORS:  # the host side is consistent; the device may be gone
            logger.exception("deactivating the rows of failed requests failed")

    # -- single-request operations -------------------------------------------------------------
    def _save(self, identity: ExecutionIdentity) -> ExecutionFailure | None:
        try:
            self.snapshots.save(identity, self.rows, self.kv)
            return None
        except RECOVERABLE_ERRORS as exc:
            logger.exception("preemption snapshot of %s failed; the request is aborted", identity)
            self.lose([identity])
            return ExecutionFailure(
                (identity,),
                f"preemption snapshot failed ({type(exc).__name__}: {exc}); the request's state "
                "could not be saved, so it cannot resume",
                FailedOperation.SNAPSHOT,
            )

    def _restore(self, identity: ExecutionIdentity) -> ExecutionFailure | None:
        try:
            self.snapshots.restore(identity, self.rows, self.kv)
            return None
        except RECOVERABLE_ERRORS as exc:
            logger.exception("restoring %s failed; the request is aborted", identity)
            self.lose([identity])
            return ExecutionFailure(
                (identity,),
                f"restoring the preempted request failed ({type(exc).__name__}: {exc})",
                FailedOperation.RESTORE,
            )


def step_identities(step: SchedulerOutput, rows: DecodeRows) -> list[ExecutionIdentity]:
    """Every request a failed step touched: its chunks, new and restored requests, block-table
    growth, remote starts, and every decoding row (the ticks run them all). Released requests
    are excluded (the scheduler is done with them); snapshotted victims were handled alone."""
    touched = [c.identity for c in step.prefill]
    touched += [n.identity for n in step.new_requests]
    touched += list(step.restores)
    touched += [b.identity for b in step.block_updates]
    touched += list(step.remote_starts)
    touched += [r.identity for r in rows.decoding_records()]
    released = set(step.released)
    return [i for i in dict.fromkeys(touched) if i not in released]
