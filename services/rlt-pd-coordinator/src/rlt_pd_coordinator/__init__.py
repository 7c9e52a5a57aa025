"""rlt-pd-coordinator: prefill/decode disaggregated serving (and the plain router baseline).

An OpenAI-compatible front (rlt-serve's app) over a `PDEngineClient`, the `EngineClient` of a
group of engine instances reached over HTTP; a `Supervisor` starts local instances as child
processes and restarts them; `rlt pd serve` (cli.py) wires it all. See README.md.
"""

from rlt_pd_coordinator.client import PDEngineClient, Timeouts
from rlt_pd_coordinator.cluster import Cluster, ClusterOptions, Instance, InstanceState
from rlt_pd_coordinator.options import CoordinationOptions, CoordinatorOptions
from rlt_pd_coordinator.server import Coordinator, build_front
from rlt_pd_coordinator.supervisor import StartupError, Supervisor, SupervisorOptions
from rlt_pd_coordinator.wire import InstanceError, InstanceUnavailableError

__all__ = [
    "Cluster",
    "ClusterOptions",
    "CoordinationOptions",
    "Coordinator",
    "CoordinatorOptions",
    "Instance",
    "InstanceError",
    "InstanceState",
    "InstanceUnavailableError",
    "PDEngineClient",
    "StartupError",
    "Supervisor",
    "SupervisorOptions",
    "Timeouts",
    "build_front",
]
