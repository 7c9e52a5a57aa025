"""Which engine replica serves a request: the routing policy, free of Ray (pure, unit-tested).

`RoutingPolicy.decide(prompt, replicas)` ranks the live replicas for one request; the Ray glue
(`rlt_ray.router`) sends the request to the first one that accepts it and records the prompt
with `routed`. README.md, "Routing, with numbers", gives the three policies, a replica's load
(`max(in_flight, ongoing)`: this router's exact count, or the replica's report, which also sees
other routers), the prefix tables and the load bound of `prefix_affinity` with a worked example.

Prefix-cache knowledge: the engines do not publish their cache contents, so the policy keeps,
per replica, the block hashes of the prompts it routed there (as SGLang's router and Ray Serve
LLM's prefix router do), chained like the engine's prefix cache: block i matches only if blocks
0..i match too. The table is an estimate (the engine evicts under KV pressure): a wrong guess
costs only a cache miss. A replica that leaves the live set loses its table (a restarted
replica's engine starts with an empty cache).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")


@dataclass(frozen=True)
class ReplicaLoad:
    """What the policy knows about one live replica when it routes a request."""

    key: str  # the replica's identity (Ray's replica id); a restarted replica has a new one
    in_flight: int = 0  # requests this router gave it that have not ended
    ongoing: int = 0  # requests the replica reported holding (every router), as of its report
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0

    @property
    def load(self) -> int:
        return max(self.in_flight, self.ongoing)

    @property
    def kv_free_fraction(self) -> float:
        return self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class Decision:
    """One routing decision, for reports and tests: the ranking, why the first was chosen, and
    the bound it was checked against."""

    ranking: tuple[str, ...]
    reason: str  # "round_robin", "least_loaded", "prefix" (affinity), "no_match", "bound"
    matched_blocks: int  # prompt blocks the chosen replica is believed to hold
    load_after: int  # the chosen replica's load once this request is on it
    cap: int  # ceil(load_factor * T / n) + load_slack at the decision (prefix_affinity), else 0


def prefix_block_hashes(prompt: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, leaving out its last token (the engine never
    reuses the final prompt token's KV: its hidden state is needed to sample token 0)."""
    usable = (len(prompt) - 1) // block_size
    hashes: list[bytes] = []
    previous = b""
    for i in range(usable):
        block = prompt[i * block_size : (i + 1) * block_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(",".join(map(str, block)).encode())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


@dataclass
class _PrefixTable:
    """Block hashes believed cached on one replica, least recently routed first."""

    capacity: int
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched(self, hashes: Sequence[bytes]) -> int:
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def add(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class RoutingPolicy:
    """Ranks replicas for a request (see the module docstring). Not thread-safe: one router
    (one asyncio loop) owns it."""

    def __init__(
        self,
        policy: str = "prefix_affinity",
        *,
        block_size: int = 16,
        load_factor: float = 1.25,
        load_slack: int = 1,
        min_match_blocks: int = 1,
        max_cached_blocks: int = 65536,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        if load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        if min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {min_match_blocks}")
        if max_cached_blocks < 1:
            raise ValueError(f"max_cached_blocks must be >= 1, got {max_cached_blocks}")
        self.policy = policy
        self.block_size = block_size
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.min_match_blocks = min_match_blocks
        self.max_cached_blocks = max_cached_blocks
        self._tables: dict[str, _PrefixTable] = {}
        self._last_picked: dict[str, int] = {}
        self._picks = 0  # decisions so far: round robin's position and the recency clock
        self.decisions = 0
        self.affinity_hits = 0  # decisions that followed a cached prefix
        self.bounded = 0  # decisions where the best prefix replica was over the bound
        self.max_load_ratio = 0.0  # largest load_after / cap seen (<= 1 by construction)
        self.recent: deque[tuple] = deque(maxlen=16)  # (reason, chosen, loads seen, cap)

    def set_policy(self, policy: str) -> None:
        """Switch policy live (the prefix tables are kept, so switching back resumes them)."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy

    # -- decisions ------------------------------------------------------------------------------
    def decide(self, prompt: Sequence[int], replicas: Sequence[ReplicaLoad]) -> Decision:
        """Rank `replicas` (at least one) for `prompt`; the first is the choice."""
        if not replicas:
            raise ValueError("no replica to route to")
        self.forget_except(r.key for r in replicas)
        if self.policy == "round_robin":
            ordered = sorted(replicas, key=lambda r: r.key)
            start = self._picks % len(ordered)
            ranking = ordered[start:] + ordered[:start]
            return self._decided(ranking, "round_robin", 0, 0)
        by_load = sorted(replicas, key=self._load_key)
        if self.policy == "least_loaded":
            return self._decided(by_load, "least_loaded", 0, 0)
        n = len(replicas)
        total = sum(r.load for r in replicas) + 1
        cap = self.cap(total, n)
        hashes = prefix_block_hashes(prompt, self.block_size)
        matches = {r.key: self._table(r.key).matched(hashes) for r in replicas}
        best = max(matches.values(), default=0)
        eligible = [r for r in by_load if r.load + 1 <= cap]
        candidates = [r for r in eligible if matches[r.key] >= self.min_match_blocks]
        if candidates:
            longest = max(matches[r.key] for r in candidates)
            chosen = next(r for r in candidates if matches[r.key] == longest)  # least loaded
            reason = "prefix"
        else:
            chosen = eligible[0] if eligible else by_load[0]
            reason = "bound" if best >= self.min_match_blocks else "no_match"
        ranking = [chosen] + [r for r in by_load if r.key != chosen.key]
        return self._decided(ranking, reason, matches[chosen.key], cap)

    def cap(self, total: int, n: int) -> int:
        """The most load a replica may have after taking a request by affinity, with `total`
        requests (the new one included) over `n` replicas."""
        return math.ceil(self.load_factor * total / n) + self.load_slack

    def _decided(
        self, ranking: Sequence[ReplicaLoad], reason: str, matched: int, cap: int
    ) -> Decision:
        chosen = ranking[0]
        self._picks += 1
        self._last_picked[chosen.key] = self._picks
        self.decisions += 1
        load_after = chosen.load + 1
        if reason == "prefix":
            self.affinity_hits += 1
        elif reason == "bound":
            self.bounded += 1
        if cap:
            self.max_load_ratio = max(self.max_load_ratio, load_after / cap)
        self.recent.append((reason, chosen.key, tuple(r.load for r in ranking), cap))
        return Decision(tuple(r.key for r in ranking), reason, matched, load_after, cap)

    def _load_key(self, replica: ReplicaLoad):
        # least load, then most free KV, then picked longest ago (never picked: first)
        return (
            replica.load,
            -replica.kv_free_fraction,
            self._last_picked.get(replica.key, 0),
            replica.key,
        )

    # -- feedback -------------------------------------------------------------------------------
    def routed(self, key: str, prompt: Sequence[int]) -> None:
        """The request with `prompt` went to replica `key`: its prefix will be cached there
        (recorded under every policy, so a live switch to prefix_affinity starts informed)."""
        self._table(key).add(prefix_block_hashes(prompt, self.block_size))

    def forget_except(self, live: Iterable[str]) -> None:
        """Drop what is known about replicas that are no longer live (a replacement starts with
        an empty cache and has a new key)."""
        live = set(live)
        for key in [k for k in self._tables if k not in live]:
            del self._tables[key]
        for key in [k for k in self._last_picked if k not in live]:
            del self._last_picked[key]

    def forget(self, key: str) -> None:
        """Drop what is known about one replica (it died)."""
        self._tables.pop(key, None)
        self._last_picked.pop(key, None)

    def cached_blocks(self, key: str) -> int:
        table = self._tables.get(key)
        return len(table.blocks) if table else 0

    def _table(self, key: str) -> _PrefixTable:
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _PrefixTable(self.max_cached_blocks)
        return table

    def report(self) -> dict:
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "load_factor": self.load_factor,
            "load_slack": self.load_slack,
            "decisions": self.decisions,
            "affinity_hits": self.affinity_hits,
            "bounded": self.bounded,
            "max_load_ratio": self.max_load_ratio,
            "cached_blocks": {k: len(t.blocks) for k, t in self._tables.items()},
            "recent": list(self.recent),
        }
