"""Request routers over a pool of instances: round robin, least loaded, prefix affinity.

Load is what the router itself counts: requests it sent to an instance that have not finished
there (for a PD prefill pool: not yet prefilled). Least loaded keeps instances in buckets by
load, so picking one costs O(1) amortized at 1,000 instances, ties going to the lowest-numbered
bucket member in a fixed order (deterministic).

Prefix affinity keeps a router-side index from block key to the instance that last received a
prompt with that block (as SGLang's cache-aware router and Ray Serve's prefix-cache-affinity
router approximate the engines' caches), bounded in size like the fleet's caches. A request
goes to the instance holding its longest indexed prefix unless that would break the load bound
of rlt-ray's policy (services/rlt-ray/src/rlt_ray/policy.py): with n instances and T = their
summed load + 1, an instance is eligible if its load + 1 <= ceil(load_factor x T / n) +
load_slack (defaults 1.25 and 1); otherwise the request goes to the least-loaded instance.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

from .traces import Request


class LoadTracker:
    """Outstanding requests per instance of one pool, with an O(1) least-loaded pick."""

    def __init__(self, members: list[int]) -> None:
        self.members = members
        self.load = {member: 0 for member in members}
        self.total = 0
        self._buckets: dict[int, dict[int, None]] = {0: dict.fromkeys(members)}
        self._min = 0

    def least_loaded(self) -> int:
        while not self._buckets.get(self._min):
            self._min += 1
        return next(iter(self._buckets[self._min]))

    def add(self, member: int, delta: int) -> None:
        old = self.load[member]
        new = old + delta
        del self._buckets[old][member]
        self._buckets.setdefault(new, {})[member] = None
        self.load[member] = new
        self.total += delta
        if new < self._min:
            self._min = new


class Router:
    name = "router"

    def __init__(self, members: list[int]) -> None:
        self.tracker = LoadTracker(members)

    def route(self, request: Request) -> int:
        member = self.choose(request)
        self.tracker.add(member, 1)
        return member

    def done(self, member: int) -> None:
        self.tracker.add(member, -1)

    def choose(self, request: Request) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, members: list[int]) -> None:
        super().__init__(members)
        self._next = 0

    def choose(self, request: Request) -> int:
        member = self.tracker.members[self._next % len(self.tracker.members)]
        self._next += 1
        return member


class LeastLoaded(Router):
    name = "least_loaded"

    def choose(self, request: Request) -> int:
        return self.tracker.least_loaded()


class PrefixAffinity(Router):
    name = "prefix_affinity"

    def __init__(
        self,
        members: list[int],
        *,
        index_blocks: int,
        load_factor: float = 1.25,
        load_slack: int = 1,
    ) -> None:
        super().__init__(members)
        self.index_blocks, self.load_factor, self.load_slack = index_blocks, load_factor, load_slack
        self._index: OrderedDict[Hashable, int] = OrderedDict()
        self.affinity_hits = 0  # requests sent where their prefix was indexed
        self.overflows = 0  # requests whose indexed instance was over the bound

    def choose(self, request: Request) -> int:
        target = -1
        for key in request.block_keys:
            member = self._index.get(key)
            if member is None:
                break
            target = member
        tracker = self.tracker
        if target >= 0:
            cap = math.ceil(self.load_factor * (tracker.total + 1) / len(tracker.members))
            if tracker.load[target] + 1 <= cap + self.load_slack:
                self.affinity_hits += 1
            else:
                self.overflows += 1
                target = -1
        if target < 0:
            target = tracker.least_loaded()
        index = self._index
        for key in request.block_keys:
            index[key] = target
            index.move_to_end(key)
        while len(index) > self.index_blocks:
            index.popitem(last=False)
        return target
