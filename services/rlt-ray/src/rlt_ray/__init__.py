"""rlt on Ray Serve: engine replicas across a Ray cluster behind rlt-serve's OpenAI-compatible
app, with a prefix-cache-affinity and load-aware request router (services/rlt-ray/README.md).

    from rlt_ray import build_app, RayOptions
    serve.run(build_app(EngineConfig.from_options(...), ServeOptions(...), RayOptions(replicas=2)))

Importing this package does not import Ray or torch; building the app does.
"""

from rlt_ray.app import RayOptions, build_app
from rlt_ray.deploy_config import app_builder
from rlt_ray.policy import POLICIES, ReplicaLoad, RoutingPolicy

__all__ = [
    "POLICIES",
    "PDOptions",
    "RayOptions",
    "ReplicaLoad",
    "RoutingPolicy",
    "app_builder",
    "build_app",
    "build_pd_app",
]


def __getattr__(name: str):
    # the PD app's module imports uvicorn and rlt-pd-coordinator: only when asked for
    if name in ("PDOptions", "build_pd_app"):
        from rlt_ray import pd

        return getattr(pd, name)
    raise AttributeError(f"module 'rlt_ray' has no attribute {name!r}")
