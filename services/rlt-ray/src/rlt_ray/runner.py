"""Running the app of `rlt ray serve` / `rlt ray pd serve` from start to exit (README.md,
"Which cluster" and "Shutdown: the drain").

Which cluster: `--address` (or else `RAY_ADDRESS`, which is printed) joins that cluster, where
only this app (`--app-name` at `--route-prefix`, refused if the name is taken) is deployed and
removed on exit; neither starts a private one-node cluster (`local_cluster.PrivateCluster`).
Nothing here calls `ray.init()` without an address, which would join whatever cluster Ray's
last-cluster file names. "ready at URL" names the address Serve's proxy actually listens on.

Stopping follows rlt's one stop-signal policy (`rlt_serve.shutdown.StopSignals`): the first
signal stops a start-up or drains (`drain.DrainSignal`) what is served, a second ends what
still runs at once, a third exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlt_contracts import ConfigurationError, RltError
from rlt_serve.shutdown import (
    EXIT_OK,
    StopRequested,
    StopSignals,
    forced_exit_code,
    signal_name,
)

from rlt_ray.drain import FLUSH_S, POLL_S, DrainSignal, drained_replicas, new_drain_key
from rlt_ray.local_cluster import ClusterStartError, PrivateCluster, free_port

logger = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
THROUGHPUT_OPTIMIZED_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# Serve's direct ingress (its throughput-optimized data plane) keeps a removed ingress replica
# for this long so that an external load balancer can deregister it; a private cluster has
# none, so its apps go as soon as their requests ended (read by the cluster's processes)
MIN_DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DELETE_WAIT_S = 15.0  # how long the exit waits for Serve to remove the app once it drained
CLUSTER_START_ATTEMPTS = 3


class AppStartError(RltError, RuntimeError):
    """Serve could not start the application (its replicas' own error in the message)."""


@dataclass(frozen=True)
class Placement:
    """Where the app goes: `address` (None: a private cluster), the app's name and route, and
    how many ingress replicas report their drain."""

    address: str | None
    app_name: str = "rlt"
    route_prefix: str = "/"
    ingress_replicas: int = 1


def cluster_address(flag: str | None) -> tuple[str | None, str]:
    """(address, where it came from): --address, else RAY_ADDRESS, else (None, "private")."""
    if flag:
        return flag, "--address"
    env = os.environ.get(RAY_ADDRESS_ENV, "").strip()
    if env:
        return env, RAY_ADDRESS_ENV
    return None, "private"


def set_ray_environment_defaults() -> None:
    """What `rlt ray serve` / `rlt ray pd serve` set before Ray starts, unless the environment
    already says otherwise (read by the processes of the local Ray instance they start; a
    cluster joined with --address has its own from `ray start`)."""
    # Under `uv run`, Ray (2.60) would start every worker through `uv run` from a packaged
    # copy of the working directory; the workers run this interpreter's environment instead.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # Serve's data plane as direct gRPC between proxy, ingress and replicas instead of Ray's
    # object streaming per chunk: on an H200 it took one replica from 0.94 to 0.97-0.99 of
    # `rlt serve`'s throughput (docs/results.md).
    os.environ.setdefault(THROUGHPUT_OPTIMIZED_ENV, "1")


def check_local_model(config, address_flag: str | None):
    """`config` (an EngineConfig) as the replicas and the ingress get it. On a private cluster
    this node runs every replica and the ingress: the model is resolved before Ray starts (a
    Hugging Face model id found in the cache or downloaded now; a `ConfigurationError` naming
    what cannot be had or what the directory lacks: exit 2), and they all get its directory
    (for an id, the cache snapshot's path, which they still call by the id). A joined
    cluster's nodes resolve it themselves: a directory at their own path, an id in their own
    Hugging Face cache."""
    if cluster_address(address_flag)[0] is not None:
        return config
    from rlt.engine.assembly import resolve_model

    model = config.model
    source = resolve_model(
        model.model, revision=model.revision, download_dir=model.download_dir, tokenizer=True
    )
    if model.model is None:
        return config
    return config.with_options(model=str(source.local_dir), revision=None)


def _say(text: str) -> None:
    print(f"rlt ray: {text}", flush=True)


class _Run:
    """One run of the command (see the module docstring)."""

    def __init__(
        self,
        build: Callable[[str], object],
        serve_options,
        placement: Placement,
        signals: StopSignals,
    ):
        self.build = build
        self.serve_options = serve_options
        self.placement = placement
        self.signals = signals
        self.cluster: PrivateCluster | None = None
        self.drain: DrainSignal | None = None
        self.deployed = False
        self.serve_was_running = True
        self.keep_logs = False  # a failed start keeps the private cluster's logs
        self.ready = False  # serving (set last in start(): a signal before it stops the start)

    # -- start ---------------------------------------------------------------------------------
    def start(self, line: str) -> None:
        address, source = cluster_address(self.placement.address)
        host, port = self.serve_options.host, self.serve_options.port
        if address is None:
            from rlt_serve.listening import check_can_listen

            port = port or free_port(host)
            check_can_listen(host, port)  # Serve's proxy binds it: a taken port fails now
        import ray  # (after the checks: a refused command line imports no Ray)
        from ray import serve

        if address is None:
            os.environ.setdefault(MIN_DRAINING_ENV, "0")
            address = self._start_private_cluster()
            _say(f"started a private Ray cluster at {address} (logs: {self.cluster.temp_dir})")
        else:
            _say(f"joining the Ray cluster at {address} (from {source})")
        # the replicas load torch: idle OpenMP workers wait passively, as under `rlt serve`
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        try:
            ray.init(address=address, logging_level=logging.WARNING, runtime_env={"env_vars": env})
        except ConnectionError as exc:
            raise ClusterStartError(f"could not join the Ray cluster at {address}: {exc}") from None
        # Serve's own notes here ("Started Serve", "New http_options will not be applied"
        # after serve.start, its own "ready" line) would contradict or repeat the lines below
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        status = serve.status()
        self.serve_was_running = bool(status.proxies or status.applications)
        name = self.placement.app_name
        if name in status.applications:
            raise ConfigurationError(
                "app_name",
                f"the Ray cluster already runs a Serve application named {name!r}: choose "
                "another with --app-name",
            )
        serve.start(http_options={"host": host, "port": port})
        key = new_drain_key(name)
        self.drain = DrainSignal(key)
        self.deployed = True
        try:
            serve.run(
                self.build(key), name=name, route_prefix=self.placement.route_prefix, blocking=False
            )
        except RltError:
            raise
        except Exception as exc:  # noqa: BLE001 - Serve's report of why the app did not start
            raise AppStartError(f"the Serve application {name!r} did not start: {exc}") from None
        _say(f"ready at {self.url()} ({line})")
        self.ready = True

    def _start_private_cluster(self) -> str:
        """Start the private cluster, again from nothing when a start failed: Ray 2.60's raylet
        gives its dashboard agent a fixed 15 s to start, which a loaded machine can exceed."""
        for attempt in range(1, CLUSTER_START_ATTEMPTS + 1):
            self.cluster = PrivateCluster()
            with self.signals.deferred():  # no interrupt between its fork and its record
                self.cluster.launch()
            try:
                return self.cluster.wait_ready()
            except ClusterStartError as exc:
                if attempt == CLUSTER_START_ATTEMPTS:
                    raise
                reason = str(exc).rsplit(": ", 1)[-1][:200]
                _say(f"the private Ray cluster did not start ({reason}); starting it again")
                self.cluster.stop()
        raise AssertionError("unreachable")

    def url(self) -> str:
        """The URL that serves: Serve's HTTP options in effect (a running Serve keeps its own),
        and the route prefix."""
        host, port = _serve_http_address(self.serve_options.host, self.serve_options.port)
        if ":" in host:
            host = f"[{host}]"
        prefix = self.placement.route_prefix.rstrip("/")
        return f"http://{host}:{port}{prefix}"

    # -- signals -------------------------------------------------------------------------------
    def on_signal(self, signum: int, stage: int) -> None:
        """The stop-signal action for the whole run (in the main thread, between bytecodes):
        during start-up the first signal unwinds it (KeyboardInterrupt) and a second exits at
        once; once serving, the main thread acts on `signals.stage` (drain, then abort) and
        only a third exits at once."""
        if not self.ready:
            if stage == 1:
                # KeyboardInterrupt, not rlt's StopRequested: the main thread may be inside a
                # blocking Ray call, whose signal check turns only KeyboardInterrupt (and
                # SystemExit) into an exception of the call (anything else: a SystemError)
                raise KeyboardInterrupt
            self.force(signum)
        elif stage >= 3:
            self.force(signum)

    def while_stopping(self, signum: int, stage: int) -> None:
        """The action while `stop()` runs: after serving, the third signal exits at once; after
        a start-up that a signal or an error ended, any further signal does."""
        if not self.ready or stage >= 3:
            self.force(signum)

    # -- serve and drain -----------------------------------------------------------------------
    def serve_until_stopped(self) -> None:
        """Serve until a stop signal, then drain (see the module docstring)."""
        while self.signals.stage == 0:
            time.sleep(POLL_S)
        grace = self.serve_options.shutdown_timeout
        name = signal_name(self.signals.signals[0])
        _say(f"{name}: draining (requests in flight have {grace:g} s to finish)")
        self.drain.request(grace)
        aborted = False
        expected = self.placement.ingress_replicas
        deadline = time.monotonic() + grace + FLUSH_S + 10 * POLL_S + 5.0
        while drained_replicas(self.drain.key) < expected:
            if self.signals.stage >= 2 and not aborted:
                aborted = True
                again = signal_name(self.signals.signals[1])
                _say(f"{again}: ending the requests still running now")
                self.drain.request(0.0)
            if time.monotonic() > deadline:
                _say("the ingress did not report its drain in time: removing the app anyway")
                break
            time.sleep(POLL_S)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Remove what this run deployed (bounded), disconnect, stop a private cluster."""
        try:
            # (deployed: connected. A private cluster whose start-up was cut short goes as a
            # whole: nothing was served, its app need not be stopped politely first)
            if self.deployed and (self.ready or self.cluster is None):
                from ray import serve

                self._delete_app(serve)
        except Exception as exc:  # noqa: BLE001 - reported; the cluster still stops
            _say(f"removing the app failed: {type(exc).__name__}: {exc}")
        finally:
            if self.drain is not None:
                self.drain.clear()
            ray = sys.modules.get("ray")  # (a command refused before Ray: nothing to do)
            if ray is not None and ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.shutdown()
            if self.cluster is not None:
                self.cluster.stop(keep_logs=self.keep_logs)
                _say("the private Ray cluster stopped")

    def _delete_app(self, serve) -> None:
        name = self.placement.app_name
        serve.delete(name, _blocking=False)
        deadline = time.monotonic() + DELETE_WAIT_S
        while name in serve.status().applications:
            if time.monotonic() > deadline:
                _say(f"Serve is still removing app {name!r} (its own draining period)")
                return
            time.sleep(POLL_S)
        _say(f"removed app {name!r}")
        if self.cluster is None and not self.serve_was_running:
            if not serve.status().applications:
                serve.shutdown()  # this command started Serve there, and nothing else uses it

    def force(self, signum: int) -> None:
        """Exit now (a private cluster is killed; an app on a joined cluster stays)."""
        if self.cluster is not None:
            self.cluster.kill_now()
        _say(f"{signal_name(signum)}: forced exit")
        sys.stdout.flush()
        os._exit(forced_exit_code(signum))


def _serve_http_address(host: str, port: int) -> tuple[str, int]:
    """The host and port Serve's proxies use (the controller's HTTP options)."""
    try:
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        return config.host, config.port
    except Exception:  # noqa: BLE001 - what was asked for, then
        return host, port


def run_app(
    build: Callable[[str], object],
    serve_options,
    placement: Placement,
    line: str,
    signals: StopSignals,
):
    """Start, serve until SIGINT / SIGTERM, drain, stop; returns the exit code. `build(key)`
    returns the Serve application whose ingress watches the drain signal `key`; `signals`: the
    command's stop-signal policy, installed (`finish()` is the caller's)."""
    run = _Run(build, serve_options, placement, signals)
    try:
        with signals.acting(run.on_signal):
            try:
                run.start(line)
            except (StopRequested, KeyboardInterrupt):  # (only `on_signal` raises the latter)
                _say(f"{signal_name(signals.signals[0])} during start-up: stopping")
                return EXIT_OK
            except ClusterStartError:
                run.keep_logs = True
                raise
            run.serve_until_stopped()
            return signals.exit_code()
    finally:
        with signals.acting(run.while_stopping):
            run.stop()
        sys.stdout.flush()
