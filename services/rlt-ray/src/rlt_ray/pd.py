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
import logging
import secrets
import time
from typing import Annotated, Any

import msgspec
from rlt_contracts import ConfigurationError, Option
from rlt_pd_coordinator.options import CoordinationOptions

from rlt_ray import registry
from rlt_ray.app import (
    DeploymentOptions,
    engine_deployment,
    ingress_deployment,
    replica_engine_config,
    resource_flag,
    router_config,
)
from rlt_ray.drain import Drainer, watch
from rlt_ray.pd_instance import PDInstanceReplica

logger = logging.getLogger(__name__)

PD_INGRESS_NAME = "RltPDIngress"
PREFILL_NAME = "RltPrefill"
DECODE_NAME = "RltDecode"


class PDOptions(DeploymentOptions, frozen=True, kw_only=True):
    """Ray PD (services/rlt-ray/README.md)

    How the prefill and decode replicas of `rlt ray pd serve` are deployed and coordinated:
    each field's flag help and README.md, "PD on Ray" (`coordination`: `rlt pd serve`'s credits
    and timeouts; `instance_api_key` None: a random one, in the deployments' arguments).
    """

    num_prefill: Annotated[int, Option("prefill replicas")] = 1
    num_decode: Annotated[int, Option("decode replicas")] = 1
    prefill_resources: Annotated[
        dict[str, float],
        resource_flag(
            "custom Ray resource each prefill replica needs (pin them to labelled nodes)",
            "prefill_resource",
        ),
    ] = msgspec.field(default_factory=dict)
    decode_resources: Annotated[
        dict[str, float],
        resource_flag("custom Ray resource each decode replica needs", "decode_resource"),
    ] = msgspec.field(default_factory=dict)
    coordination: CoordinationOptions = msgspec.field(default_factory=CoordinationOptions)
    discovery_period_s: Annotated[
        float, Option("how often replicas report their URL and load, and the ingress applies it")
    ] = 1.0
    instance_api_key: Annotated[
        str | None,
        Option(
            "API key of the instances' HTTP servers (default: a random one)",
            env="RLT_INSTANCE_API_KEY",
        ),
    ] = None
    startup_timeout_s: float = 600.0  # the ingress waits this long for a first P and D
    max_ongoing_requests: int = 1024

    def validate(self) -> None:
        super().validate()
        for name in ("num_prefill", "num_decode"):
            if getattr(self, name) < 1:
                raise ConfigurationError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("discovery_period_s", "startup_timeout_s"):
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
        from rlt_pd_coordinator import Cluster, ClusterOptions, PDEngineClient
        from rlt_pd_coordinator.model_files import build_model_info, load_tokenizer, resolve_model

        self.options = options
        self.serve_options = serve_options
        self.roles = ((PDRole.PREFILL, PREFILL_NAME), (PDRole.DECODE, DECODE_NAME))
        self.cluster = Cluster(
            [],
            ClusterOptions(
                mode="pd",
                api_key=options.instance_api_key,
                poll_interval=options.coordination.poll_interval,
                credit_wait=options.coordination.credit_wait,
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
        self.client = PDEngineClient(self.cluster, info, timeouts=options.coordination.timeouts)
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

        coordination = self.options.coordination
        credits = {"prefill": coordination.prefill_credits, "decode": coordination.decode_credits}
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
    from rlt.engine.config import EngineConfig
    from rlt_serve.front_options import ServeOptions

    serve_options = serve_options or ServeOptions()
    options = options or PDOptions()
    options.validate()
    config, gpus = replica_engine_config(
        config or EngineConfig.from_options(),
        options,
        "rlt ray pd serve sets each deployment's role: leave --pd-role out",
    )
    key = options.instance_api_key or secrets.token_urlsafe(24)
    options = msgspec.structs.replace(options, instance_api_key=key)
    router = router_config("rlt_ray.router:MembershipRouter", options.discovery_period_s)

    def engines(role: str, name: str, count: int, resources: dict[str, float]):
        deployment = engine_deployment(
            PDInstanceReplica,
            name,
            options,
            gpus,
            resources,
            num_replicas=count,
            request_router_config=router,
        )
        return deployment.bind(config.with_options(pd_role=role), role, key)

    prefill = engines("prefill", PREFILL_NAME, options.num_prefill, options.prefill_resources)
    decode = engines("decode", DECODE_NAME, options.num_decode, options.decode_resources)
    ingress = ingress_deployment(PDIngress, PD_INGRESS_NAME, 1, options, serve_options)
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
