"""The engine instances behind one coordinator: their state, load, credits and connections.

`Cluster` owns the HTTP client every other part uses, and:
- admits instances: fetches `/internal/pd/info` and `/v1/models`, checks the role each was
  started or listed for, checks compatibility (every prefill instance against every decode
  instance; replicas only on the model), and connects prefill and decode instances with each
  other's transport metadata (`/internal/pd/connect`). A mismatch refuses the instance with a
  message naming every differing field.
- picks an instance per role, least loaded among the ready ones with a free credit (README.md,
  "State": the order, and the 503 / 429 when none can take it).
- polls every ready or unreachable instance's info every `poll_interval` seconds (load,
  reachability, and restarts: a transport agent other than the one admitted means the
  instance restarted, or was never admitted, and it is admitted again, reconnecting its peers).
- changes membership when a cluster manager (rlt-ray) says so: `add` admits a new instance
  in the background, `remove` forgets one whose process is gone for good. The instances
  given at construction (`rlt pd serve`) never change.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec
from rlt_contracts import ConfigurationError, EngineDeadError, OverloadedError
from rlt_contracts.pd import PDRole

from rlt_pd_coordinator.wire import (
    CONNECT_PATH,
    INFO_PATH,
    MODELS_PATH,
    ConnectBody,
    InstanceError,
    InstanceInfo,
    InstanceLoad,
    encode,
    error_from_response,
    info_decoder,
    models_decoder,
)

logger = logging.getLogger("rlt_pd_coordinator")

# What replicas of a plain router must share (the KV layout may differ between them).
MODEL_FIELDS = ("model_identity", "num_layers", "num_loops")


class InstanceState(enum.StrEnum):
    STARTING = "starting"  # process starting, or being (re)admitted: not routable
    READY = "ready"  # admitted and reachable: routable
    UNREACHABLE = "unreachable"  # a request or poll could not reach it; polled until it answers
    DEAD = "dead"  # its process exited; the supervisor restarts it
    STOPPED = "stopped"  # the coordinator is shutting down


@dataclass(eq=False)
class Instance:
    """One engine instance (a local child process or a URL)."""

    name: str
    role: PDRole
    url: str
    credits: int
    local: bool = False
    state: InstanceState = InstanceState.STARTING
    reason: str = "not admitted yet"
    info: InstanceInfo | None = None
    model_id: str | None = None  # the model name its /v1/models reports
    max_model_len: int | None = None
    num_loops: int | None = None
    in_flight: int = 0
    last_pick: int = 0
    pid: int | None = None
    restarts: int = 0
    # the transport agent this coordinator admitted and connected (None: not admitted yet,
    # or its last admission failed); another agent at a poll means a new process
    admitted_agent: str | None = None

    def __str__(self) -> str:
        return f"{self.role} instance {self.name} ({self.url})"

    @property
    def load(self) -> InstanceLoad:
        return self.info.load if self.info is not None else InstanceLoad()

    def pick_key(self) -> tuple:
        load = self.load
        return (self.in_flight, load.running + load.waiting, -load.kv_blocks_free, self.last_pick)

    def snapshot(self) -> dict:
        """JSON-ready view (the coordinator's /v1/pd/instances)."""
        load = self.load
        return {
            "name": self.name,
            "role": str(self.role),
            "url": self.url,
            "local": self.local,
            "pid": self.pid,
            "state": str(self.state),
            "reason": self.reason if self.state is not InstanceState.READY else None,
            "restarts": self.restarts,
            "in_flight": self.in_flight,
            "credits": self.credits,
            "agent": self.info.agent if self.info else None,
            "load": msgspec.structs.asdict(load),
        }


@dataclass(frozen=True)
class ClusterOptions:
    mode: str = "pd"  # "pd": prefill + decode instances; "router": replicas (role none)
    api_key: str | None = None  # the instances' API key (sent as a bearer token)
    connect_timeout: float = 5.0  # TCP connect to an instance
    request_timeout: float = 30.0  # info / models / connect calls
    poll_interval: float = 1.0
    credit_wait: float = 30.0  # how long a request waits for a free credit


@dataclass
class Cluster:
    instances: list[Instance]
    options: ClusterOptions = field(default_factory=ClusterOptions)

    def __post_init__(self) -> None:
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=self.options.connect_timeout,
                read=self.options.request_timeout,
                write=self.options.request_timeout,
                pool=None,
            ),
            # every request holds one streaming connection per instance it uses: no pool cap
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            headers=self.auth_headers(),
            trust_env=False,
        )
        self._picks = 0
        self._changed = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._readmitting: dict[Instance, asyncio.Task] = {}
        self._admitting = asyncio.Lock()
        self._closed = False

    # -- roles --------------------------------------------------------------------------------
    @property
    def output_role(self) -> PDRole:
        """The role whose instances stream the tokens (decode, or the replicas' none)."""
        return PDRole.DECODE if self.options.mode == "pd" else PDRole.NONE

    @property
    def required_roles(self) -> tuple[PDRole, ...]:
        if self.options.mode == "pd":
            return (PDRole.PREFILL, PDRole.DECODE)
        return (PDRole.NONE,)

    def of_role(self, role: PDRole) -> list[Instance]:
        return [i for i in self.instances if i.role is role]

    def auth_headers(self) -> dict[str, str]:
        key = self.options.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def unavailable_reason(self) -> str | None:
        """Why requests cannot be served now (no ready instance of a needed role), or None."""
        for role in self.required_roles:
            members = self.of_role(role)
            if not any(i.state is InstanceState.READY for i in members):
                return f"no {role} instance is available ({_states(members)})"
        return None

    # -- admission ----------------------------------------------------------------------------
    async def fetch_info(self, instance: Instance) -> InstanceInfo:
        response = await self.http.get(instance.url + INFO_PATH)
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content, str(instance))
        try:
            return info_decoder.decode(response.content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InstanceError(f"{instance} sent an invalid {INFO_PATH} answer: {exc}") from None

    async def describe(self, instance: Instance) -> None:
        """Fetch info and model card, and check the role; the instance stays unroutable."""
        try:
            info = await self.fetch_info(instance)
            response = await self.http.get(instance.url + MODELS_PATH)
            if response.status_code != 200:
                raise error_from_response(response.status_code, response.content, str(instance))
            card = models_decoder.decode(response.content).data[0]
        except httpx.HTTPError as exc:
            raise InstanceError(f"cannot reach {instance}: {_describe(exc)}") from None
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
            raise InstanceError(f"{instance} sent an invalid {MODELS_PATH} answer: {exc}") from None
        if info.role is not instance.role:
            raise ConfigurationError(
                "role",
                f"{instance.url} was given as a {instance.role} instance but reports role "
                f"{info.role!s} (start it with --pd-role {instance.role})",
            )
        if instance.role is not PDRole.NONE and (info.compatibility is None or not info.metadata):
            raise InstanceError(f"{instance} reports no transport metadata or compatibility")
        instance.info = info
        instance.model_id = card.id
        instance.max_model_len = card.max_model_len
        instance.num_loops = card.num_loops

    def mismatches(self, instance: Instance, others: Iterable[Instance]) -> list[str]:
        """One line per peer that `instance` must match but does not, naming every differing
        field with both values (`PDCompatibility`; replicas are only compared on the model)."""
        problems = []
        mine = instance.info.compatibility if instance.info else None
        for other in others:
            theirs = other.info.compatibility if other.info else None
            if other is instance or mine is None or theirs is None:
                continue
            names = mine.__struct_fields__ if self.options.mode == "pd" else MODEL_FIELDS
            diffs = [
                f"{name} {getattr(mine, name)!r} on {instance.name}, "
                f"{getattr(theirs, name)!r} on {other.name}"
                for name in names
                if getattr(mine, name) != getattr(theirs, name)
            ]
            if diffs:
                problems.append(f"{instance} vs {other}: " + "; ".join(diffs))
        return problems

    def peers_of(self, instance: Instance) -> list[Instance]:
        """The instances `instance` must be compatible and connected with."""
        if instance.role is PDRole.PREFILL:
            return self.of_role(PDRole.DECODE)
        if instance.role is PDRole.DECODE:
            return self.of_role(PDRole.PREFILL)
        return self.of_role(PDRole.NONE)

    async def connect(self, instance: Instance, peers: Sequence[Instance]) -> None:
        """`POST /internal/pd/connect` on `instance` with the peers' metadata."""
        metadata = [p.info.metadata for p in peers if p.info is not None]
        if instance.role is PDRole.NONE or not metadata:
            return
        try:
            response = await self.http.post(
                instance.url + CONNECT_PATH,
                content=encode(ConnectBody(peers=metadata)),
                headers={"Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise InstanceError(
                f"cannot connect {instance} to its peers: {_describe(exc)}"
            ) from None
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content, str(instance))

    async def admit_all(self) -> None:
        """Startup: describe every instance, refuse any incompatibility (all of them named in
        one error), connect each prefill instance to every decode instance and back, and
        mark all ready."""
        await asyncio.gather(*(self.describe(i) for i in self.instances))
        self._check_model_shape(self.instances)
        problems: list[str] = []
        for index, instance in enumerate(self.instances):  # each pair once
            later = [p for p in self.instances[index + 1 :] if p in self.peers_of(instance)]
            problems += self.mismatches(instance, later)
        if problems:
            raise ConfigurationError(
                "compatibility", "incompatible instances:\n  " + "\n  ".join(problems)
            )
        await asyncio.gather(*(self.connect(i, self.peers_of(i)) for i in self.instances))
        for instance in self.instances:
            instance.admitted_agent = instance.info.agent if instance.info else ""
            self._set_ready(instance)

    async def admit(self, instance: Instance) -> None:
        """(Re)admit one instance (a restart): check it against the admitted peers, connect it
        to them and them to it, then route to it. Raises on a mismatch (it stays unroutable).

        One admission at a time: two instances admitted concurrently would each see the other
        as not ready yet, connect to neither, and both become ready unconnected (a handoff
        between them then fails: "prefill agent ... is not connected here")."""
        async with self._admitting:
            await self._admit(instance)

    async def _admit(self, instance: Instance) -> None:
        instance.state = InstanceState.STARTING
        instance.reason = "being admitted"
        instance.admitted_agent = None
        await self.describe(instance)
        admitted = [
            p
            for p in self.peers_of(instance)
            if p is not instance and p.state is InstanceState.READY and p.info is not None
        ]
        self._check_model_shape([instance, *admitted])
        problems = self.mismatches(instance, admitted)
        if problems:
            raise ConfigurationError(
                "compatibility", "incompatible instances:\n  " + "\n  ".join(problems)
            )
        if instance.role is not PDRole.NONE:
            await self.connect(instance, admitted)
            await asyncio.gather(*(self.connect(p, [instance]) for p in admitted))
        instance.admitted_agent = instance.info.agent if instance.info else ""
        self._set_ready(instance)

    def _check_model_shape(self, instances: Sequence[Instance]) -> None:
        loops = {i.num_loops for i in instances if i.num_loops is not None}
        if len(loops) > 1:
            listing = ", ".join(f"{i.name}: {i.num_loops}" for i in instances)
            raise ConfigurationError(
                "num_loops", f"the instances serve different models ({listing})"
            )

    def _set_ready(self, instance: Instance) -> None:
        if self._closed:
            return
        if instance.state is not InstanceState.READY:
            logger.info("%s is ready (agent %s)", instance, instance.info and instance.info.agent)
        instance.state = InstanceState.READY
        instance.reason = ""
        self._notify()

    # -- state changes ------------------------------------------------------------------------
    def mark_unreachable(self, instance: Instance, reason: str) -> None:
        if instance.state is InstanceState.READY:
            logger.warning("%s is unreachable: %s; routing around it", instance, reason)
            instance.state = InstanceState.UNREACHABLE
            instance.reason = reason
            self._notify()

    def mark_dead(self, instance: Instance, reason: str) -> None:
        instance.state = InstanceState.DEAD
        instance.reason = reason
        self._notify()

    def mark_starting(self, instance: Instance, reason: str) -> None:
        instance.state = InstanceState.STARTING
        instance.reason = reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- picking ------------------------------------------------------------------------------
    def try_acquire(self, role: PDRole, exclude: Iterable[Instance] = ()) -> Instance | None:
        """Take a credit on the least loaded ready instance of `role` (None: all are full).
        Raises EngineDeadError when no instance of the role is ready."""
        excluded = set(exclude)
        members = self.of_role(role)
        ready = [i for i in members if i.state is InstanceState.READY and i not in excluded]
        if not ready:
            detail = _states(members)
            raise EngineDeadError(f"no {role} instance is available ({detail})")
        free = [i for i in ready if i.in_flight < i.credits]
        if not free:
            return None
        chosen = min(free, key=Instance.pick_key)
        self._picks += 1
        chosen.last_pick = self._picks
        chosen.in_flight += 1
        return chosen

    async def acquire(self, role: PDRole, exclude: Iterable[Instance] = ()) -> Instance:
        """`try_acquire`, waiting up to `credit_wait` seconds for a credit."""
        excluded = tuple(exclude)
        deadline = time.monotonic() + self.options.credit_wait
        while True:
            chosen = self.try_acquire(role, excluded)
            if chosen is not None:
                return chosen
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                members = [i for i in self.of_role(role) if i.state is InstanceState.READY]
                raise OverloadedError(
                    f"every {role} instance is at its limit of requests in flight "
                    f"({', '.join(f'{i.name}: {i.in_flight}/{i.credits}' for i in members)})"
                )
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass

    def release(self, instance: Instance) -> None:
        instance.in_flight -= 1
        self._notify()

    # -- polling ------------------------------------------------------------------------------
    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_loop(), name="rlt-pd-poller")

    async def _poll_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.options.poll_interval)
            targets = [
                i
                for i in self.instances
                if i.state in (InstanceState.READY, InstanceState.UNREACHABLE)
                and i not in self._readmitting
            ]
            await asyncio.gather(*(self.poll(i) for i in targets))

    async def poll(self, instance: Instance) -> None:
        """Refresh one instance's info: its load, whether it is reachable, whether it restarted."""
        try:
            info = await asyncio.wait_for(self.fetch_info(instance), self.options.request_timeout)
        except (httpx.HTTPError, InstanceError, TimeoutError) as exc:
            self.mark_unreachable(instance, f"info poll failed: {_describe(exc)}")
            return
        if instance.state not in (InstanceState.READY, InstanceState.UNREACHABLE):
            return  # the supervisor took over meanwhile
        if info.agent != instance.admitted_agent:
            # a new process (a restart: new transport agent), or an admission that failed
            # (refused or unreachable peers): admit it again before routing to it
            logger.warning(
                "%s reports agent %s, admitted: %s; admitting it again",
                instance,
                info.agent or "(none)",
                instance.admitted_agent,
            )
            self._start_admission(instance, "restarted; being admitted again")
            return
        instance.info = info
        if instance.state is InstanceState.UNREACHABLE:
            logger.info("%s is reachable again", instance)
            self._set_ready(instance)

    def _start_admission(self, instance: Instance, reason: str) -> None:
        self.mark_starting(instance, reason)

        async def readmit() -> None:
            try:
                await self.admit(instance)
            except Exception as exc:  # noqa: BLE001 - logged; polled again later
                instance.state = InstanceState.UNREACHABLE
                instance.reason = f"admission failed: {exc}"
                logger.error("%s could not be admitted again: %s", instance, exc)
            finally:
                self._readmitting.pop(instance, None)

        self._readmitting[instance] = asyncio.create_task(readmit())

    # -- membership (a cluster manager adds and removes instances) ----------------------------
    def add(self, instance: Instance) -> None:
        """A new instance (a replica a cluster manager started): admitted in the background
        (checked against the ready peers, connected with them both ways) and routed to once
        that succeeded; a failed admission is retried at the next polls."""
        if self._closed or instance in self.instances:
            return
        self.instances.append(instance)
        self._start_admission(instance, "new; being admitted")

    def remove(self, instance: Instance, reason: str) -> None:
        """Forget an instance whose process is gone for good (the cluster manager replaced or
        removed it): it is never picked again. Requests already on it end through their own
        connections and return their credits to the detached `Instance`. Its transport agent
        stays known to the peers it was connected with: nothing addresses it any more (every
        handoff names its decode agent), so it is inert."""
        if instance not in self.instances:
            return
        task = self._readmitting.pop(instance, None)
        if task is not None:
            task.cancel()
        self.instances.remove(instance)
        instance.state = InstanceState.STOPPED
        instance.reason = reason
        logger.info("%s removed: %s", instance, reason)
        self._notify()

    # -- shutdown -----------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._poller, *self._readmitting.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for instance in self.instances:
            instance.state = InstanceState.STOPPED
            instance.reason = "the coordinator is shutting down"
        await self.http.aclose()


def _states(instances: Sequence[Instance]) -> str:
    if not instances:
        return "none configured"
    return ", ".join(
        f"{i.name}: {i.state}" + (f" ({i.reason})" if i.reason else "") for i in instances
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
