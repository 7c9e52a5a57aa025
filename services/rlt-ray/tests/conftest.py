"""One local three-node Ray cluster (`ray.cluster_utils.Cluster`) for every Ray test here.

Starting it (three raylets, GCS, Serve's controller and proxy) is most of these tests' time
on a 2-core machine, so the modules that need it share it (every test that uses it carries
the `rlt-ray-cluster` xdist group, so they run on one worker, one after the other), each
deploying its own Serve application and deleting it when the module ends; the cluster stops
after the last of them.

Nodes and their custom resources (placement is real: each deployment asks for one of them):

    head      rlt_head 1, rlt_replica 1, rlt_prefill 1   Serve controller, proxy, ingresses
    worker 1  rlt_replica 1, rlt_decode 1
    worker 2  rlt_replica 1, rlt_decode 1

`rlt ray serve` tests run two `rlt_replica` engines (a replacement has one free node);
`rlt ray pd serve` tests run one prefill replica on the head and a decode replica on each
worker, so every handoff crosses nodes.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

import pytest

ENV = {
    # Ray's `uv run` integration would rebuild the workspace for every worker: the test
    # processes already run in it
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "OMP_NUM_THREADS": "1",  # the same as the in-process reference engines (float reductions)
    "OMP_WAIT_POLICY": "PASSIVE",
    # Serve's controller kills a proxy not ready within 5 s (and one whose health check takes
    # 10 s): a 2-core machine busy with the rest of the suite can take longer (seen: serve.start
    # failed with the proxy "killed by ray.kill" before it ever ran)
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    # what `rlt ray serve` sets for the Ray instance it starts (rlt_ray.cli): the tests run
    # Serve's direct gRPC data plane too
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # its direct ingress drains a removed app's ingress for at least 30 s (time for a load
    # balancer to notice, which no test has): each module's app goes in 1 s
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    # the autoscaling test's load reaches Serve's controller within a second (default 10 s)
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
DRIVER_ROUTER_ENV = "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"
# Ray reads this one once, when it is first imported: a test that imports Ray before the
# cluster starts (building an app, `rlt_ray.app`) would otherwise fix it at "on" for this
# process, and the cluster's workers of a driver run under `uv run` would start through `uv
# run` in a copy of the working directory, without Ray (seen: every worker crashed at start)
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", ENV["RAY_ENABLE_UV_RUN_RUNTIME_ENV"])


@pytest.fixture
def unset_ray_defaults(monkeypatch):
    """The variables `rlt_ray.runner.set_ray_environment_defaults` sets, unset for a test that
    calls it (or `cli.main`) and restored after it. monkeypatch.delenv of an absent variable
    records nothing to restore, so a value set by the code under test would outlive the test,
    and Serve, imported later in this process, would read it (a throughput-optimized driver's
    handles need an event loop: see `ray_cluster`)."""
    for name in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_ENABLE_UV_RUN_RUNTIME_ENV"):
        monkeypatch.setenv(name, "")  # records the value before the test, or its absence
        monkeypatch.delenv(name)


@dataclass
class RayCluster:
    cluster: object
    port: int
    head_node_id: str
    phases: list[str] = field(default_factory=list)
    saved_env: dict[str, str | None] = field(default_factory=dict)  # restored at the stop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ensure_nodes(self, resource: str, count: int) -> None:
        """At least `count` live nodes offer `resource` (an earlier test may have removed a
        node): add workers with one of it until they do."""
        import ray

        def live() -> int:
            return sum(
                1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) >= 1
            )

        missing = count - live()
        for _ in range(missing):
            self.cluster.add_node(num_cpus=1, resources={resource: 1, "rlt_replica": 1})
        if missing > 0:
            self.cluster.wait_for_nodes()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_running: RayCluster | None = None  # the cluster, between its first user and its last


@pytest.fixture(scope="module")
def ray_cluster():
    """The cluster, started by the first module that needs it and shared by the next ones;
    stopped (`pytest_runtest_teardown` below) after the last of a run of such tests, so that it
    does not load the 2 CPUs while the rest of the suite runs (xdist sends the
    `rlt-ray-cluster` group to one worker as one run)."""
    global _running
    if _running is None:
        _running = _start_cluster()
    yield _running


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the item's fixtures (a module's app) are gone; the cluster may go too
    global _running
    if _running is not None and (nextitem is None or "ray_cluster" not in nextitem.fixturenames):
        cluster, _running = _running, None
        _stop_cluster(cluster)


STARTUP_ATTEMPTS = 3


def _start_cluster() -> RayCluster:
    """Start the cluster, again (from nothing) if the start failed: Ray gives a new node's
    raylet a fixed 30 s to register with the GCS (ray._private.node), which a 2-core machine
    busy with the rest of the suite can exceed (seen once in a whole run)."""
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        try:
            return _try_start_cluster()
        except Exception as exc:  # noqa: BLE001 - a failed start is stopped whole: retried
            if attempt == STARTUP_ATTEMPTS:
                raise
            print(f"\nrlt-ray test cluster: attempt {attempt} failed ({exc}); starting again")
    raise AssertionError("unreachable")


def _kill_session_processes(session_dir: str) -> None:
    """SIGKILL every process of this cluster's Ray session (found by the session directory
    on its command line): a node whose start failed is not in the Cluster, so its shutdown
    does not stop its processes."""
    import signal

    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
        except OSError:
            continue
        if session_dir in command:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def _try_start_cluster() -> RayCluster:
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    # This process calls Serve handles from synchronous test code, which the throughput-
    # optimized setting refuses (its routers run on the caller's event loop): here only, the
    # router keeps its own loop. Read when ray.serve is first imported, and unset before any
    # node starts, so the cluster runs what `rlt ray serve` runs.
    os.environ[DRIVER_ROUTER_ENV] = "1"
    try:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster
    finally:
        del os.environ[DRIVER_ROUTER_ENV]

    started = time.monotonic()
    phases: list[str] = []

    def phase(name: str) -> None:
        phases.append(f"{name} {time.monotonic() - started:.1f} s")

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"rlt_head": 1, "rlt_replica": 1, "rlt_prefill": 1},
            "include_dashboard": False,
            "no_monitor": True,  # no autoscaler: one Python process less
            "_system_config": {
                # a removed node is declared dead after ~3 missed 1 s health checks
                "health_check_period_ms": 1000,
                "health_check_failure_threshold": 3,
                # no idle Python workers started ahead of need (2 CPUs are shared by all)
                "enable_worker_prestart": False,
                "prestart_worker_first_driver": False,
            },
        },
    )
    running = RayCluster(cluster, 0, cluster.head_node.node_id, phases, saved)
    try:
        for _ in range(2):
            cluster.add_node(wait=False, num_cpus=1, resources={"rlt_replica": 1, "rlt_decode": 1})
        cluster.wait_for_nodes()
        phase("3 nodes")
        ray.init(
            address=cluster.address,
            logging_level="WARNING",
            log_to_driver=False,
            runtime_env={"env_vars": dict(ENV)},
        )
        running.port = _free_port()
        serve.start(
            http_options={"host": "127.0.0.1", "port": running.port}, proxy_location="HeadOnly"
        )
        phase("serve")
        print(f"\nrlt-ray test cluster up: {', '.join(phases)}")
        return running
    except BaseException:
        session_dir = cluster.head_node.get_session_dir_path()
        _stop_cluster(running)
        _kill_session_processes(session_dir)
        raise


def _stop_cluster(running: RayCluster) -> None:
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
        running.cluster.shutdown()
        for key, value in running.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
