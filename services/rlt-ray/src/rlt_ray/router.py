"""`RltRequestRouter`: Ray Serve's request-router plug-in around `rlt_ray.policy`.

Ray Serve (2.60) lets a deployment name a `RequestRouter` class; every handle to the engine
deployment (the ingress's) runs one instance, on the handle's process. For each call Ray asks
`choose_replicas(candidates, pending_request)` for ranks of replicas and sends the request to
the least-queued replica of the first rank that accepts it (`max_ongoing_requests`), falling
back to later ranks. This class only translates:

- in: the live replicas (`RunningReplica`: id, and `routing_stats`, which the controller
  fetches from each replica's `record_routing_stats` every `request_routing_stats_period_s`)
  and the pending call (a `generate` call carries the `EngineRequest`, whose prompt token ids
  the policy hashes);
- out: `[[the policy's choice], [the rest by load]]`.

Ray ships this class by value (cloudpickle), so this module holds no state of its own: the
routers of a process are found through `rlt_ray.registry`.

Its own state (README.md, "Routing, with numbers"): requests in flight per replica (Ray's
`on_send_request` .. `on_request_completed`), reservations (a decision not yet followed by its
send: Ray routes several requests concurrently, so without them a burst would be decided
against counts that miss its own earlier requests; one never consumed expires after
`RESERVATION_S`) and the policy's prefix tables, recorded when the choice is made. A replica
that died or left (`update_replicas`) loses all of it. Calls other than `generate`
(model_info, stats) are ranked least loaded and not recorded.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from rlt_contracts import EngineRequest

from rlt_ray import registry
from rlt_ray.policy import ReplicaLoad, RoutingPolicy

logger = logging.getLogger(__name__)

RESERVATION_S = 2.0


class RltRequestRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = "prefix_affinity",
        block_size: int = 16,
        load_factor: float = 1.25,
        load_slack: int = 1,
        max_cached_blocks: int = 65536,
        **_ignored,
    ) -> None:
        self.policy = RoutingPolicy(
            policy,
            block_size=block_size,
            load_factor=load_factor,
            load_slack=load_slack,
            max_cached_blocks=max_cached_blocks,
        )
        self.in_flight: Counter[str] = Counter()  # requests sent to each replica, not ended
        self.reserved: dict[str, deque[float]] = {}  # decisions not yet sent: their times
        self.routed_total: Counter[str] = Counter()
        # the ingress of this process reads reports and switches the policy live through it
        registry.register(self._deployment_id.name, self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [self._load(r) for r in candidate_replicas]
        request = _engine_request(pending_request)
        if request is None:
            ranked = sorted(loads, key=lambda load: (load.load, -load.kv_free_fraction, load.key))
            return [[by_key[load.key] for load in ranked]]
        decision = self.policy.decide(request.prompt_token_ids, loads)
        chosen = decision.ranking[0]
        self.reserved.setdefault(chosen, deque()).append(time.monotonic())
        self.routed_total[chosen] += 1
        self.policy.routed(chosen, request.prompt_token_ids)
        rest = [by_key[key] for key in decision.ranking[1:]]
        return [[by_key[chosen]], rest] if rest else [[by_key[chosen]]]

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        key = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        return ReplicaLoad(
            key,
            in_flight=self.in_flight[key] + self._reservations(key),
            ongoing=int(stats.get("ongoing", 0)),
            kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
            kv_blocks_total=int(stats.get("kv_blocks_total", 0)),
        )

    def _reservations(self, key: str) -> int:
        pending = self.reserved.get(key)
        if not pending:
            return 0
        horizon = time.monotonic() - RESERVATION_S
        while pending and pending[0] < horizon:
            pending.popleft()
        return len(pending)

    # -- Ray's lifecycle hooks ------------------------------------------------------------------
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        key = replica_id.unique_id
        self.in_flight[key] += 1
        pending = self.reserved.get(key)
        if pending:
            pending.popleft()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        key = replica_id.unique_id
        if self.in_flight[key] > 1:
            self.in_flight[key] -= 1
        else:
            self.in_flight.pop(key, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for key in [k for k in {*self.in_flight, *self.reserved} if k not in live]:
            self._forget(key)
        self.policy.forget_except(live)

    def _forget(self, key: str) -> None:
        self.in_flight.pop(key, None)
        self.reserved.pop(key, None)
        self.policy.forget(key)

    def report(self) -> dict:
        """The policy's counters plus, per live replica, requests in flight from this router,
        requests routed there so far and its last reported engine load."""
        replicas = {}
        for replica in list(self.curr_replicas.values()):
            key = replica.replica_id.unique_id
            replicas[key] = {
                "in_flight": self.in_flight[key] + self._reservations(key),
                "routed": self.routed_total[key],
                "routing_stats": dict(replica.routing_stats or {}),
                "cached_blocks": self.policy.cached_blocks(key),
            }
        return {**self.policy.report(), "replicas": replicas}


class MembershipRouter(RequestRouter):
    """The router of rlt ray pd serve's prefill and decode handles: what matters there is not
    routing (the coordinator in the ingress picks instances itself and talks to them over
    HTTP) but membership: which replicas Ray runs now, and what each last reported from
    `record_routing_stats` (its URL, role, transport agent, pid, node, load). The ingress
    reads that through `members()` (found in `rlt_ray.registry`). The few calls made through
    these handles (`describe`) go to any replica."""

    def initialize_state(self, **_ignored) -> None:
        registry.register(self._deployment_id.name, self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return [list(candidate_replicas)] if candidate_replicas else []

    def members(self) -> dict[str, dict]:
        """Replica id -> its last routing stats ({} until its first report)."""
        return {
            r.replica_id.unique_id: dict(r.routing_stats or {})
            for r in list(self.curr_replicas.values())
        }


def _engine_request(pending_request: PendingRequest | None) -> EngineRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, EngineRequest) else None
