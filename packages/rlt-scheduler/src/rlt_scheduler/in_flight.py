"""Steps in flight: scheduled steps whose results were not applied yet (README.md, "Steps in
flight"): each submitted step adds its per-request output bounds to `unconfirmed_tokens` and
its ticks to the request's unconfirmed ticks; applying its results (oldest first) takes them
back and adds the ticks to `confirmed_ticks`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rlt_contracts import ExecutionIdentity, SchedulerOutput

from rlt_scheduler.request_state import ScheduledRequest


@dataclass(frozen=True)
class SubmittedStep:
    """A scheduled step whose results have not been applied yet.

    output_bounds: per request, the most outputs the step can make (tokens).
    decoding: requests that loop in the step's `decode_ticks` (decoding rows, remote starts and
    completing chunks that sample token 0).
    """

    output: SchedulerOutput
    output_bounds: dict[ExecutionIdentity, int]
    decoding: frozenset[ExecutionIdentity]


class StepsInFlight:
    """Owns the submitted steps (oldest first) and each request's unconfirmed ticks.

    The per-request counters it updates (`unconfirmed_tokens`, `confirmed_ticks`) belong to the
    requests the scheduler's lookups return; nothing here touches queues.
    """

    def __init__(self) -> None:
        self._submitted: deque[SubmittedStep] = deque()
        self._unconfirmed_ticks: dict[ExecutionIdentity, int] = {}
        self._unconfirmed_rounds: dict[ExecutionIdentity, int] = {}

    def __len__(self) -> int:
        return len(self._submitted)

    @property
    def unconfirmed_ticks(self) -> Mapping[ExecutionIdentity, int]:
        """Ticks of submitted steps per decoding request (read-only view)."""
        return self._unconfirmed_ticks

    @property
    def unconfirmed_rounds(self) -> Mapping[ExecutionIdentity, int]:
        """Speculative rounds of submitted steps per decoding request (read-only view): each
        makes at least one output of a request that does not stop."""
        return self._unconfirmed_rounds

    def submit(
        self, step: SubmittedStep, lookup: Callable[[ExecutionIdentity], ScheduledRequest]
    ) -> None:
        """Record a just-scheduled step: its ticks count as unconfirmed for every request that
        loops in it, its output bounds as the requests' unconfirmed tokens."""
        self._submitted.append(step)
        for identity in step.decoding:
            for counts, added in (
                (self._unconfirmed_ticks, step.output.decode_ticks),
                (self._unconfirmed_rounds, step.output.speculative_rounds),
            ):
                if added:
                    counts[identity] = counts.get(identity, 0) + added
        for identity, bound in step.output_bounds.items():
            lookup(identity).unconfirmed_tokens += bound

    def confirm_oldest(
        self,
        step_id: int,
        *,
        same_identity: Callable[[ExecutionIdentity], ScheduledRequest | None],
        live: Callable[[ExecutionIdentity], ScheduledRequest | None],
    ) -> SubmittedStep:
        """The results of step `step_id` arrived: it must be the oldest submitted step
        (RuntimeError otherwise). Its output bounds leave `unconfirmed_tokens` of the request
        that still has that identity (`same_identity`, finished ones included); its ticks move
        from unconfirmed to `confirmed_ticks` of the live request (`live`)."""
        if not self._submitted or self._submitted[0].output.step_id != step_id:
            expected = self._submitted[0].output.step_id if self._submitted else None
            raise RuntimeError(f"result of step {step_id}, expected step {expected}")
        submitted = self._submitted.popleft()
        for identity, bound in submitted.output_bounds.items():
            request = same_identity(identity)
            if request is not None:
                request.unconfirmed_tokens -= bound
        ticks = submitted.output.decode_ticks
        for identity in submitted.decoding:
            request = live(identity)
            if request is not None:
                request.confirmed_ticks += ticks
            _take(self._unconfirmed_ticks, identity, ticks)
            _take(self._unconfirmed_rounds, identity, submitted.output.speculative_rounds)
        return submitted


def _take(counts: dict[ExecutionIdentity, int], identity: ExecutionIdentity, done: int) -> None:
    left = counts.get(identity, 0) - done
    if left > 0:
        counts[identity] = left
    else:
        counts.pop(identity, None)
