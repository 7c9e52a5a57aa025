"""`rlt ray pd serve`: prefill/decode disaggregation on Ray Serve (README.md, "PD on Ray", has
the deployment graph, one request's handoff and the failure rules).

Three deployments in one application: prefill and decode replicas (`PDInstanceReplica`, each
exactly one `rlt serve --pd-role` instance with its own HTTP server) and an ingress that runs
the coordinator of `rlt pd serve` (`rlt_pd_coordinator.PDEngineClient` over a `Cluster`,
imported, not copied). Ray places, health-checks and restarts the replicas; what this module
adds is membership: the engine handles carry `MembershipRouter`, and every
`discovery_period_s` the ingress adds the replicas Ray runs to the `Cluster` and removes the
ones it no longer lists. A replica Ray replaced is a new instance (new id, URL and transport
agent: a new handoff generation), never the old one come back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rlt_contracts import ConfigurationError

from rlt_ray import registry
from rlt_ray.drain import Drainer, serve_shutdown_options, watch
from rlt_ray.pd_instance import PDInstanceReplica

logger = logging.getLogger(__name__)

PD_INGRESS_NAME = "RltPDIngress"
PREFILL_NAME = "RltPrefill"
DECODE_NAME = "RltDecode"


@dataclass(frozen=True)
class PDOptions:
    """How the prefill and decode replicas are deployed and coordinated (engine options live
    in EngineConfig, HTTP options in rlt's ServeOptions).

    num_prefill / num_decode: replicas of each role.
    num_gpus: GPUs per replica; None: 1 when the engine runs on CUDA, else 0.
    num_cpus: CPUs Ray reserves per replica (scheduling only).
    prefill_resources / decode_resources: custom Ray resources each replica of that role
      needs: label nodes (`ray start --resources '{"rlt_prefill": 4}'`) to pin each role to its
      nodes. Without them Serve spreads replicas over the nodes (best effort).
    max_replicas_per_node: per deployment (None: no limit).
    ingress_resources: custom Ray resources of the ingress (e.g. keep it on the head).
    prefill_credits / decode_credits, admission_timeout_s, transfer_timeout_s, credit_wait_s,
      poll_interval_s: the coordinator's (`rlt pd serve --prefill-credits ...`).
    discovery_period_s: how often replicas report their URL and load to the ingress's
      membership routers, and how often the ingress applies what they report.
    startup_timeout_s: how long the ingress waits for a first prefill and decode instance to
      be admitted.
    instance_api_key: the key the coordinator sends to the instances' HTTP servers (None: a
      random one; it travels in the deployments' arguments).
    """

    num_prefill: int = 1
    num_decode: int = 1
    num_gpus: float | None = None
    num_cpus: float = 1.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    max_replicas_per_node: int | None = None
    ingress_resources: dict[str, float] = field(default_factory=dict)
    prefill_credits: int = 32
    decode_credits: int = 128
    admission_timeout_s: float = 60.0
    transfer_timeout_s: float = 120.0
    credit_wait_s: float = 30.0
    poll_interval_s: float = 1.0
    discovery_period_s: float = 1.0
    startup_timeout_s: float = 600.0
    instance_api_key: str | None = None
    max_ongoing_requests: int = 1024
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 10.0

    def validate(self) -> None:
        for name in ("num_prefill", "num_decode", "prefill_credits", "decode_credits"):
            if getattr(self, name) < 1:
                raise ConfigurationError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise ConfigurationError(
                "max_replicas_per_node", f"must be >= 1, got {self.max_replicas_per_node}"
            )
        for name in ("num_cpus", "num_gpus", "credit_wait_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigurationError(name, f"must be >= 0, got {value}")
        for name in (
            "admission_timeout_s",
            "transfer_timeout_s",
            "poll_interval_s",
            "discovery_period_s",
            "startup_timeout_s",
            "health_check_period_s",
            "health_check_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)}")


class PDIngress:
    """The HTTP front of `rlt ray pd serve`: rlt-pd-coordinator's coordinator over the
    instances that Ray runs (see the module docstring). `prefill` / `decode`: handles to the
    engine deployments (their routers report membership); `model`: the checkpoint directory
    whose tokenizer and config this front reads (None: the bundled model), or a Hugging Face
    model id at `revision` in the Hugging Face cache `download_dir` (None: main,
    huggingface_hub's cache); `serve_options`: rlt's `ServeOptions`; `options`: `PDOptions`;
    `drain_key`: the command's drain signal (`rlt_ray.drain`; None: Serve's own shutdown)."""

    async def __init__(
        self,
        prefill,
        decode,
        model,
        serve_options,
        options: PDOptions,
        drain_key=None,
        revision: str | None = None,
        download_dir: str | None = None,
    ) -> None:
        from rlt_contracts.pd import PDRole
        from rlt_pd_coordinator import Cluster, ClusterOptions, PDEngineClient, Timeouts
        from rlt_pd_coordinator.server import build_model_info, load_tokenizer, resolve_model

        self.options = options
        self.serve_options = serve_options
        self.roles = ((PDRole.PREFILL, PREFILL_NAME), (PDRole.DECODE, DECODE_NAME))
        self.cluster = Cluster(
            [],
            ClusterOptions(
                mode="pd",
                api_key=options.instance_api_key,
                poll_interval=options.poll_interval_s,
                credit_wait=options.credit_wait_s,
            ),
        )
        self.known: dict[str, Any] = {}  # Ray replica id -> the cluster's Instance
        source = resolve_model(model, revision=revision, download_dir=download_dir)
        model_dir = source.local_dir
        loading = asyncio.create_task(asyncio.to_thread(load_tokenizer, model_dir))
        # a first call to each deployment starts its handle's router (membership) and waits
        # for a first replica of each role
        await asyncio.gather(prefill.describe.remote(), decode.describe.remote())
        self._syncing = asyncio.create_task(self._sync_loop(), name="rlt-pd-membership")
        await self._wait_admitted(options.startup_timeout_s)
        self.tokenizer = await loading
        self.cluster.start_polling()
        model_name = serve_options.served_model_name or source.name
        info = build_model_info(model_dir, model_name, self.cluster.instances)
        self.client = PDEngineClient(
            self.cluster,
            info,
            timeouts=Timeouts(
                admission=options.admission_timeout_s, transfer=options.transfer_timeout_s
            ),
        )
        self._handles = (prefill, decode)  # keep the routers alive
        self.drainer: Drainer | None = None
        self._watching = (
            asyncio.create_task(watch(drain_key, lambda: self.drainer)) if drain_key else None
        )

    def __serve_build_asgi_app__(self):
        self.drainer = Drainer(self._front(), self.client.shutdown)
        return self.drainer

    def _front(self):
        from rlt_pd_coordinator import build_front

        return build_front(self.client, self.tokenizer, self.serve_options)

    # -- membership ---------------------------------------------------------------------------
    def sync(self) -> None:
        """Apply Ray's replica set to the coordinator's cluster: add what is new (once it
        reported its URL), remove what Ray no longer lists."""
        from rlt_pd_coordinator import Instance

        credits = {"prefill": self.options.prefill_credits, "decode": self.options.decode_credits}
        live: set[str] = set()
        for role, deployment in self.roles:
            router = registry.find(deployment)
            members = router.members() if router is not None else {}
            for key, stats in members.items():
                live.add(key)
                url = stats.get("url")
                if key in self.known or not url:
                    continue
                instance = Instance(
                    f"{role}-{key}", role, url, credits[str(role)], pid=stats.get("pid")
                )
                self.known[key] = instance
                self.cluster.add(instance)
        for key in [k for k in self.known if k not in live]:
            self.cluster.remove(self.known.pop(key), "Ray Serve no longer runs this replica")

    async def _sync_loop(self) -> None:
        while True:
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                logger.exception("PD membership update failed")
            await asyncio.sleep(self.options.discovery_period_s)

    async def _wait_admitted(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (reason := self.cluster.unavailable_reason()) is not None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no PD pair was admitted within {timeout_s:g} s: {reason}")
            await asyncio.sleep(0.1)

    # -- operators and tests ------------------------------------------------------------------
    async def instances(self) -> list[dict]:
        """The coordinator's view (as `GET /v1/pd/instances`), plus each replica's last
        report (pid, node, agent, KV blocks, transfers pending)."""
        reports = {}
        for _, deployment in self.roles:
            router = registry.find(deployment)
            if router is not None:
                reports.update(router.members())
        by_instance = {id(i): k for k, i in self.known.items()}
        views = []
        for instance in list(self.cluster.instances):
            key = by_instance.get(id(instance))
            views.append({**instance.snapshot(), "replica": key, "report": reports.get(key, {})})
        return views

    async def __del__(self) -> None:
        for task in (getattr(self, "_syncing", None), getattr(self, "_watching", None)):
            if task is not None:
                task.cancel()
        client = getattr(self, "client", None)
        if client is not None:
            await client.shutdown()
        else:
            cluster = getattr(self, "cluster", None)
            if cluster is not None:
                await cluster.close()


def build_pd_app(config=None, serve_options=None, options: PDOptions | None = None, drain_key=None):
    """The Ray Serve application of `rlt ray pd serve`: `serve.run(build_pd_app(...))`.

    config: rlt's `EngineConfig` for every instance (its `pd_role` must stay "none": each
    deployment sets its own; the `pd_*` timeouts apply); serve_options: rlt's `ServeOptions`
    for the front (API key, served model name, body limit, loop defaults; host/port are
    Serve's HTTP options); options: `PDOptions`; drain_key: the drain signal the ingress
    watches (`rlt_ray.drain`, the command's; None: Serve's own graceful shutdown only).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from rlt.engine.config import EngineConfig
    from rlt_serve.front_options import ServeOptions

    from rlt_ray.app import replica_engine_config

    serve_options = serve_options or ServeOptions()
    options = options or PDOptions()
    options.validate()
    config, gpus = replica_engine_config(
        config or EngineConfig.from_options(),
        options,
        "rlt ray pd serve sets each deployment's role: leave --pd-role out",
    )
    key = options.instance_api_key or secrets.token_urlsafe(24)
    options = dataclasses.replace(options, instance_api_key=key)
    router_config = RequestRouterConfig(
        request_router_class="rlt_ray.router:MembershipRouter",
        request_routing_stats_period_s=options.discovery_period_s,
        request_routing_stats_timeout_s=max(options.discovery_period_s * 5, 5.0),
    )

    def engines(role: str, name: str, count: int, resources: dict[str, float]):
        actor_options: dict[str, Any] = {"num_cpus": options.num_cpus, "num_gpus": gpus}
        if resources:
            actor_options["resources"] = dict(resources)
        spread = {}
        if options.max_replicas_per_node is not None:
            spread["max_replicas_per_node"] = options.max_replicas_per_node
        deployment = serve.deployment(PDInstanceReplica).options(
            name=name,
            num_replicas=count,
            ray_actor_options=actor_options,
            max_ongoing_requests=options.max_ongoing_requests,
            health_check_period_s=options.health_check_period_s,
            health_check_timeout_s=options.health_check_timeout_s,
            request_router_config=router_config,
            **serve_shutdown_options(options.graceful_shutdown_timeout_s, ingress=False),
            **spread,
        )
        return deployment.bind(config.with_options(pd_role=role), role, key)

    prefill = engines("prefill", PREFILL_NAME, options.num_prefill, options.prefill_resources)
    decode = engines("decode", DECODE_NAME, options.num_decode, options.decode_resources)
    ingress = serve.deployment(serve.ingress()(PDIngress)).options(
        name=PD_INGRESS_NAME,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": dict(options.ingress_resources)},
        max_ongoing_requests=max(options.max_ongoing_requests, 1024),
        **serve_shutdown_options(serve_options.shutdown_timeout, ingress=True),
    )
    model = config.model
    download_dir = None if model.download_dir is None else str(model.download_dir)
    return ingress.bind(
        prefill,
        decode,
        model.model,
        serve_options,
        options,
        drain_key,
        model.revision,
        download_dir,
    )
