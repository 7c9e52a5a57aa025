"""`WaitingQueue`: requests waiting for admission (new or preempted), in policy order."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from rlt_contracts import SchedulingPolicy

from rlt_scheduler.request_state import ScheduledRequest


class WaitingQueue:
    """Ordered by arrival (FCFS) or by (priority, arrival) (PRIORITY). A preempted request keeps
    its arrival index, so it returns ahead of requests that arrived after it."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._keys: list[tuple[int, int]] = []
        self._items: list[ScheduledRequest] = []

    def _key(self, request: ScheduledRequest) -> tuple[int, int]:
        if self._policy is SchedulingPolicy.PRIORITY:
            return (request.sampling.priority, request.arrival_index)
        return (0, request.arrival_index)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(list(self._items))

    def add(self, request: ScheduledRequest) -> None:
        key = self._key(request)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._items.insert(index, request)

    def remove(self, request: ScheduledRequest) -> None:
        index = self._items.index(request)
        del self._keys[index]
        del self._items[index]
