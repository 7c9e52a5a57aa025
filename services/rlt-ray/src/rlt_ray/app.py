"""Building the Ray Serve application of `rlt ray serve`: `build_app(...)` in Python (for
`serve run` / `serve deploy` config files: `rlt_ray.deploy_config.app_builder`).

    HTTP (Serve's proxy) -> OpenAIIngress (rlt-serve's app, tokenizer, the request router)
                              -> RltEngine replicas (one engine each, num_gpus=1 on CUDA)

Two deployments in one application: `RltIngress` (`ingress_replicas`, CPU only) and `RltEngine`
(`replicas`, or autoscaled between `min_replicas` and `max_replicas` on ongoing requests per
replica, Ray's measure of queue length: queued at the replica plus running).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from rlt_contracts import ConfigurationError, Option

from rlt_ray.policy import POLICIES

INGRESS_NAME = "RltIngress"
ENGINE_NAME = "RltEngine"


def resource_amount(text: str) -> tuple[str, float]:
    """One custom Ray resource of a repeatable NAME=AMOUNT flag (AMOUNT > 0): the flags of
    the resources fields (`--replica-resource`, `--prefill-resource`, `--decode-resource`)."""
    name, sep, amount = text.partition("=")
    try:
        value = float(amount)
    except ValueError:
        value = -1.0
    if not sep or not name or value <= 0:
        raise ValueError(f"expected NAME=AMOUNT with AMOUNT > 0, got {text!r}")
    return name, value


def resource_flag(help: str, name: str) -> Option:
    """The flag of a custom-Ray-resources field: --NAME NAME=AMOUNT, repeatable."""
    return Option(help, name=name, metavar="NAME=AMOUNT", parse=resource_amount)


class DeploymentOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What both Ray commands take (each field an option of `rlt ray serve` and `rlt ray pd
    serve`, rlt_contracts.options): the cluster and the app's name and route, which the command
    reads (`rlt_ray.runner`, not the app builders), and what each engine replica asks Ray for
    and how Ray checks it.

    num_gpus: GPUs per replica; None: 1 when the engine runs on CUDA (device "cuda", or "auto"
      on a cluster with GPUs), else 0.
    num_cpus: CPUs Ray reserves per replica (scheduling only; torch threads are not limited).
    max_replicas_per_node: spread replicas over nodes (None: no limit; per deployment).
    ingress_resources: custom Ray resources each ingress replica needs (keep the HTTP front
      off the GPU nodes, or on the head).
    graceful_shutdown_timeout_s: the commands' --shutdown-timeout.
    """

    address: Annotated[
        str | None,
        Option(
            "Ray cluster to join ('auto': the one this node belongs to; host:port); default: "
            "$RAY_ADDRESS if set, else a private local cluster that stops with the command"
        ),
    ] = None
    app_name: Annotated[
        str,
        Option(
            "the Serve application's name on the cluster (refused if it runs one of that "
            "name already); default: rlt"
        ),
    ] = "rlt"
    route_prefix: Annotated[
        str, Option("the route the API is served under (e.g. /rlt: http://HOST:PORT/rlt/v1/...)")
    ] = "/"
    num_gpus: Annotated[
        float | None,
        Option(
            "GPUs each engine replica asks Ray for (default: 1 when the engine runs on CUDA, "
            "else 0)",
            flags=("--num-gpus-per-replica",),
        ),
    ] = None
    num_cpus: Annotated[
        float, Option("CPUs each engine replica asks Ray for", flags=("--num-cpus-per-replica",))
    ] = 1.0
    max_replicas_per_node: Annotated[
        int | None, Option("most engine replicas Ray places on one node (default: no limit)")
    ] = None
    health_check_period_s: Annotated[
        float, Option("seconds between Ray Serve's health checks of a replica")
    ] = 10.0
    health_check_timeout_s: Annotated[
        float, Option("seconds a health check may take before the replica counts as unhealthy")
    ] = 30.0
    ingress_resources: dict[str, float] = msgspec.field(default_factory=dict)
    graceful_shutdown_timeout_s: float = 10.0

    def validate(self) -> None:
        for name, value, minimum in (
            ("max_replicas_per_node", self.max_replicas_per_node, 1),
            ("num_cpus", self.num_cpus, 0),
            ("num_gpus", self.num_gpus, 0),
        ):
            if value is not None and value < minimum:
                raise ConfigurationError(name, f"must be >= {minimum}, got {value}")
        for name in ("health_check_period_s", "health_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)}")


class RayOptions(DeploymentOptions, frozen=True, kw_only=True):
    """Ray (services/rlt-ray/README.md)

    How the engine replicas of `rlt ray serve` are deployed and routed: each field's flag help,
    README.md's "Command line" (autoscaling, --engine-process) and "Routing, with numbers".
    max_ongoing_requests stays above the engine's own limits so the engine's queue (and its
    429) decides.
    """

    replicas: Annotated[int, Option("engine replicas")] = 1
    min_replicas: Annotated[
        int | None,
        Option("autoscale from this many (with --max-replicas; default: none, --replicas fixed)"),
    ] = None
    max_replicas: Annotated[
        int | None,
        Option("autoscale up to this many (with --min-replicas; default: none, --replicas fixed)"),
    ] = None
    target_ongoing_requests: Annotated[
        float, Option("autoscaling target: ongoing (queued + running) requests per replica")
    ] = 16.0
    autoscale_look_back_s: Annotated[
        float, Option("autoscaling: window the load is averaged over")
    ] = 30.0
    upscale_delay_s: Annotated[
        float, Option("autoscaling: load above target this long adds replicas")
    ] = 30.0
    downscale_delay_s: Annotated[
        float, Option("autoscaling: below target this long removes them")
    ] = 600.0
    router: Annotated[
        str,
        Option(
            "how requests are spread over replicas (default: prefix_affinity)", choices=POLICIES
        ),
    ] = "prefix_affinity"
    load_factor: Annotated[
        float,
        Option(
            "prefix_affinity's load bound: a replica takes a request by affinity only while "
            "its load stays <= ceil(factor x mean load) + --load-slack"
        ),
    ] = 1.25
    load_slack: Annotated[
        int, Option("requests a replica may take by affinity above --load-factor's bound")
    ] = 1
    resources: Annotated[
        dict[str, float],
        resource_flag("custom Ray resource each replica needs (repeatable)", "replica_resource"),
    ] = msgspec.field(default_factory=dict)
    ingress_replicas: Annotated[
        int, Option("replicas of the HTTP front (tokenization and routing; CPU only)")
    ] = 1
    max_ongoing_requests: Annotated[int, Option("per replica")] = 1024
    routing_stats_period_s: Annotated[
        float, Option("how often each replica reports its load to the router")
    ] = 1.0
    submit_timeout_s: Annotated[
        float, Option("seconds the front waits for an engine replica to take a request")
    ] = 60.0
    engine_process: Annotated[
        bool,
        Option(
            "each replica's engine core in a process of its own, as under `rlt serve` "
            "(default: on a thread of the replica's process)",
            negatable=True,
        ),
    ] = False
    block_size: int | None = None

    def validate(self) -> None:
        def positive(name: str, value, minimum=1) -> None:
            if value is not None and value < minimum:
                raise ConfigurationError(name, f"must be >= {minimum}, got {value}")

        super().validate()
        positive("replicas", self.replicas)
        positive("ingress_replicas", self.ingress_replicas)
        positive("max_ongoing_requests", self.max_ongoing_requests)
        positive("min_replicas", self.min_replicas, 0)
        positive("max_replicas", self.max_replicas)
        positive("load_slack", self.load_slack, 0)
        positive("block_size", self.block_size)
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise ConfigurationError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in (
            "target_ongoing_requests",
            "autoscale_look_back_s",
            "routing_stats_period_s",
            "submit_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)}")
        if self.router not in POLICIES:
            raise ConfigurationError("router", f"must be one of {', '.join(POLICIES)}")
        if not self.load_factor >= 1.0:
            raise ConfigurationError("load_factor", f"must be >= 1.0, got {self.load_factor}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigurationError(
                ("min_replicas", "max_replicas"), "autoscaling needs both bounds"
            )
        if self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise ConfigurationError(
                ("min_replicas", "max_replicas"),
                f"min {self.min_replicas} exceeds max {self.max_replicas}",
            )

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


def engine_gpus(config, options: RayOptions) -> float:
    """GPUs one engine replica asks Ray for (see RayOptions.num_gpus)."""
    if options.num_gpus is not None:
        return options.num_gpus
    device = str(config.runner.device)
    if device.startswith("cuda"):
        return 1.0
    if device == "auto":
        import ray

        if ray.is_initialized():
            return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    return 0.0


def replica_engine_config(config, options, pd_role_refusal: str):
    """The engine config every replica of a deployment runs, and the GPUs each asks Ray for:
    a device index is refused (Ray assigns each replica its GPU), so is a `pd_role` (the
    deployment decides roles; `pd_role_refusal` says why), and "auto" without a GPU is the
    CPU."""
    if str(config.runner.device).startswith("cuda:"):
        raise ConfigurationError(
            "device", "give --device cuda: Ray assigns each replica its GPU (CUDA_VISIBLE_DEVICES)"
        )
    if config.pd.role != "none":
        raise ConfigurationError("pd_role", pd_role_refusal)
    gpus = engine_gpus(config, options)
    if gpus == 0 and str(config.runner.device) == "auto":
        config = config.with_options(device="cpu")
    return config, gpus


def router_config(router_class: str, stats_period_s: float, kwargs: dict | None = None):
    """An engine deployment's request router (rlt_ray.router), stats every `stats_period_s`."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=router_class,
        request_router_kwargs=kwargs or {},
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(stats_period_s * 5, 5.0),
    )


def engine_deployment(replica_class, name: str, options, gpus: float, resources, **more):
    """Engine replicas as both commands deploy them (`options`: RayOptions or PDOptions);
    `more`: Serve's other deployment options (replica count or autoscaling, the router)."""
    from ray import serve

    from rlt_ray.drain import serve_shutdown_options

    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus, "num_gpus": gpus}
    if resources:
        actor_options["resources"] = dict(resources)
    if options.max_replicas_per_node is not None:
        more["max_replicas_per_node"] = options.max_replicas_per_node
    return serve.deployment(replica_class).options(
        name=name,
        ray_actor_options=actor_options,
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        **serve_shutdown_options(options.graceful_shutdown_timeout_s, ingress=False),
        **more,
    )


def ingress_deployment(ingress_class, name: str, replicas: int, options, serve_options):
    """The HTTP front's deployment: CPU only, on the nodes `options.ingress_resources` name."""
    from ray import serve

    from rlt_ray.drain import serve_shutdown_options

    return serve.deployment(serve.ingress()(ingress_class)).options(
        name=name,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0, "resources": dict(options.ingress_resources)},
        max_ongoing_requests=max(options.max_ongoing_requests, 1024),
        **serve_shutdown_options(serve_options.shutdown_timeout, ingress=True),
    )


def build_app(config=None, serve_options=None, options: RayOptions | None = None, drain_key=None):
    """The Ray Serve application: `serve.run(build_app(...))`.

    config: rlt's `EngineConfig` for every replica (default: the bundled model on the CPU or
    CUDA, "auto"); serve_options: rlt's `ServeOptions` (API key, served model name, body limit,
    loop defaults, CORS origins; host/port are Serve's HTTP options instead); options:
    `RayOptions`; drain_key: the drain signal the ingress watches (`rlt_ray.drain`, the
    command's; None: Serve's own graceful shutdown only).
    """
    from rlt.engine.config import EngineConfig
    from rlt_serve.front_options import ServeOptions

    from rlt_ray.ingress import OpenAIIngress
    from rlt_ray.replicas import EngineReplica

    serve_options = serve_options or ServeOptions()
    options = options or RayOptions()
    options.validate()
    config, gpus = replica_engine_config(
        config or EngineConfig.from_options(),
        options,
        "rlt ray serve runs whole engines (--pd-role none)",
    )
    scaling: dict[str, Any] = {"num_replicas": options.replicas}
    if options.autoscaling:
        scaling = {
            "autoscaling_config": {
                "min_replicas": options.min_replicas,
                "initial_replicas": max(options.min_replicas, 1),
                "max_replicas": options.max_replicas,
                "target_ongoing_requests": options.target_ongoing_requests,
                "look_back_period_s": options.autoscale_look_back_s,
                "upscale_delay_s": options.upscale_delay_s,
                "downscale_delay_s": options.downscale_delay_s,
            }
        }
    router = {
        "policy": options.router,
        "block_size": options.block_size or config.runner.block_size,
        "load_factor": options.load_factor,
        "load_slack": options.load_slack,
    }
    engine = engine_deployment(
        EngineReplica,
        ENGINE_NAME,
        options,
        gpus,
        options.resources,
        request_router_config=router_config(
            "rlt_ray.router:RltRequestRouter", options.routing_stats_period_s, router
        ),
        **scaling,
    )
    ingress = ingress_deployment(
        OpenAIIngress, INGRESS_NAME, options.ingress_replicas, options, serve_options
    )
    return ingress.bind(
        engine.bind(config, engine_process=options.engine_process),
        config.model.model,
        serve_options,
        options.submit_timeout_s,
        drain_key,
        config.model.revision,
        None if config.model.download_dir is None else str(config.model.download_dir),
    )
