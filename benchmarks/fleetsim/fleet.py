"""The event loop: requests reach a router, instances run steps, PD handoffs copy KV.

Events (a heap of (time, sequence, kind, ...)): a request reaching the router (its arrival plus
the front end's time), an instance's step ending, and a PD handoff landing on its decode
instance. An instance with work always has exactly one step in flight, so the event count is
about one per instance step plus two or three per request.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from .curves import InstanceCosts
from .instance import EngineLimits, Instance, Role
from .routers import LeastLoaded, PrefixAffinity, RoundRobin, Router
from .traces import Request, Trace

POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "pd")
_ARRIVE, _STEP, _LAND = 0, 1, 2


@dataclass(frozen=True)
class FleetConfig:
    gpus: int
    policy: str
    pd_ratio: tuple[int, int] = (1, 1)  # prefill : decode instances (policy "pd")
    limits: EngineLimits = field(default_factory=EngineLimits)
    mean_loops: float = 4.0  # loops per decoded token (4: fixed depth; 2.47: the measured mix)
    drain_s: float = 60.0  # simulated time allowed after the trace's horizon

    @property
    def label(self) -> str:
        if self.policy == "pd":
            return f"pd {self.pd_ratio[0]}:{self.pd_ratio[1]}"
        return self.policy


class Fleet:
    def __init__(self, config: FleetConfig, costs: InstanceCosts) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {config.policy!r}")
        self.config, self.costs = config, costs
        limits = config.limits
        index_blocks = config.gpus * limits.kv_capacity_tokens // limits.block_tokens
        if config.policy == "pd":
            prefill, decode = config.pd_ratio
            num_prefill = max(
                1, min(config.gpus - 1, round(config.gpus * prefill / (prefill + decode)))
            )
            roles = [Role.PREFILL] * num_prefill + [Role.DECODE] * (config.gpus - num_prefill)
        else:
            roles = [Role.MIXED] * config.gpus
        self.instances = [
            Instance(i, role, costs, limits, mean_loops=config.mean_loops)
            for i, role in enumerate(roles)
        ]
        first_pool = [i for i, role in enumerate(roles) if role is not Role.DECODE]
        self.decode_router: Router | None = None
        if config.policy == "pd":
            self.router: Router = PrefixAffinity(first_pool, index_blocks=index_blocks)
            self.decode_router = LeastLoaded([i for i, r in enumerate(roles) if r is Role.DECODE])
        elif config.policy == "round_robin":
            self.router = RoundRobin(first_pool)
        elif config.policy == "least_loaded":
            self.router = LeastLoaded(first_pool)
        else:
            self.router = PrefixAffinity(first_pool, index_blocks=index_blocks)
        self._events: list[tuple] = []
        self._sequence = 0
        self.events_processed = 0
        self.completions = 0  # requests that produced their last token

    def run(self, trace: Trace) -> list[Request]:
        """Simulate `trace` to the end (or the horizon plus `drain_s`); every request created."""
        front_end_s = self.costs.calibration.front_end_ms / 1000.0
        requests = trace.initial()
        for request in requests:
            self._push(request.arrival_s + front_end_s, _ARRIVE, request)
        stop_s = trace.horizon_s + self.config.drain_s
        handoff_ms = self.costs.calibration.handoff_ms
        chunk = self.config.limits.prefill_chunk
        events, instances = self._events, self.instances
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > stop_s:
                break
            self.events_processed += 1
            if kind == _STEP:
                instance = instances[payload]
                instance.busy = False
                outcome = instance.finish_step(now)
                for request in outcome.prefilled:  # PD: start the copy of the last chunk
                    self.router.done(payload)
                    request.prefill_instance = payload
                    request.decode_instance = self.decode_router.route(request)
                    copy_ms = self.costs.transfer_ms(min(request.prompt_tokens, chunk))
                    self._push(now + (copy_ms + handoff_ms) / 1000.0, _LAND, request)
                self.completions += len(outcome.finished)
                for request in outcome.finished:
                    if instance.role is Role.DECODE:
                        self.decode_router.done(payload)
                    else:
                        self.router.done(payload)
                    follow_up = trace.follow_up(request)
                    if follow_up is not None:
                        requests.append(follow_up)
                        self._push(follow_up.arrival_s + front_end_s, _ARRIVE, follow_up)
                self._kick(instance, now)
            elif kind == _ARRIVE:
                member = self.router.route(payload)
                instances[member].enqueue(payload)
                self._kick(instances[member], now)
            else:  # _LAND
                instances[payload.prefill_instance].release(payload)
                decode = instances[payload.decode_instance]
                decode.enqueue(payload)
                self._kick(decode, now)
        return requests

    def _kick(self, instance: Instance, now: float) -> None:
        if instance.busy:
            return
        step_ms = instance.start_step()
        if step_ms is not None:
            instance.busy = True
            self._push(now + step_ms / 1000.0, _STEP, instance.index)

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (time_s, self._sequence, kind, payload))


def unfinished(requests: list[Request]) -> int:
    return sum(1 for r in requests if r.finish_s == math.inf)
