"""`rlt ray serve [MODEL] ...` and `rlt ray pd serve [MODEL] ...` (also `rlt-ray ...` and
`python -m rlt_ray ...`).

The engine and HTTP flags are `rlt serve`'s own (rlt.cli; not `--api-server-count`:
`--ingress-replicas` scales the front); the Ray flags say how many replicas, where they run
and how requests are routed (`serve`), or how many prefill and decode replicas run where and
the coordinator's credits and timeouts (`pd serve`). Which cluster, the start, the drain and
the exit: `rlt_ray.runner`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import msgspec
from rlt_contracts import ConfigurationError, RltError, build_options
from rlt_serve.cli_help import explain_defaults, parse_command_line
from rlt_serve.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from rlt_serve.shutdown import StopRequested, StopSignals, signal_name

from rlt_ray.app import RayOptions
from rlt_ray.local_cluster import ClusterStartError
from rlt_ray.policy import POLICIES
from rlt_ray.runner import (
    THROUGHPUT_OPTIMIZED_ENV,  # noqa: F401 - documented here too (tests, `rlt ray` users)
    AppStartError,
    set_ray_environment_defaults,
)

APP_NAME = "rlt"
logger = logging.getLogger(__name__)


def _add_placement_arguments(group, d) -> None:
    """The flags both commands share: the cluster, and what each engine replica asks Ray for
    and how Ray checks it (`d`: the command's options with their defaults)."""
    group.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto': the one this node belongs to; host:port); default: "
        "$RAY_ADDRESS if set, else a private local cluster that stops with the command",
    )
    group.add_argument(
        "--app-name",
        default=APP_NAME,
        help="the Serve application's name on the cluster (refused if it runs one of that "
        "name already); default: rlt",
    )
    group.add_argument(
        "--route-prefix",
        default="/",
        help="the route the API is served under (e.g. /rlt: http://HOST:PORT/rlt/v1/...)",
    )
    group.add_argument(
        "--num-gpus-per-replica",
        dest="num_gpus",
        type=float,
        default=None,
        help="GPUs each engine replica asks Ray for (default: 1 when the engine runs on CUDA, "
        "else 0)",
    )
    group.add_argument(
        "--num-cpus-per-replica",
        dest="num_cpus",
        type=float,
        default=d.num_cpus,
        help="CPUs each engine replica asks Ray for",
    )
    group.add_argument(
        "--max-replicas-per-node",
        type=int,
        default=None,
        help="most engine replicas Ray places on one node (default: no limit)",
    )
    group.add_argument(
        "--health-check-period-s",
        type=float,
        default=d.health_check_period_s,
        help="seconds between Ray Serve's health checks of a replica",
    )
    group.add_argument(
        "--health-check-timeout-s",
        type=float,
        default=d.health_check_timeout_s,
        help="seconds a health check may take before the replica counts as unhealthy",
    )


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    d = RayOptions()
    group = parser.add_argument_group("Ray (services/rlt-ray/README.md)")
    _add_placement_arguments(group, d)
    group.add_argument("--replicas", type=int, default=d.replicas, help="engine replicas")
    group.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscale from this many (with --max-replicas; default: none, --replicas fixed)",
    )
    group.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale up to this many (with --min-replicas; default: none, --replicas fixed)",
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=d.target_ongoing_requests,
        help="autoscaling target: ongoing (queued + running) requests per replica",
    )
    for flag, default, what in (
        ("--autoscale-look-back-s", d.autoscale_look_back_s, "window the load is averaged over"),
        ("--upscale-delay-s", d.upscale_delay_s, "load above target this long adds replicas"),
        ("--downscale-delay-s", d.downscale_delay_s, "below target this long removes them"),
    ):
        group.add_argument(flag, type=float, default=default, help=f"autoscaling: {what}")
    group.add_argument(
        "--router",
        default=d.router,
        choices=POLICIES,
        help="how requests are spread over replicas (default: prefix_affinity)",
    )
    group.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help="prefix_affinity's load bound: a replica takes a request by affinity only while "
        "its load stays <= ceil(factor x mean load) + --load-slack",
    )
    group.add_argument(
        "--load-slack",
        type=int,
        default=d.load_slack,
        help="requests a replica may take by affinity above --load-factor's bound",
    )
    group.add_argument(
        "--replica-resource",
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="custom Ray resource each replica needs (repeatable)",
    )
    group.add_argument(
        "--ingress-replicas",
        type=int,
        default=d.ingress_replicas,
        help="replicas of the HTTP front (tokenization and routing; CPU only)",
    )
    group.add_argument(
        "--max-ongoing-requests", type=int, default=d.max_ongoing_requests, help="per replica"
    )
    group.add_argument(
        "--routing-stats-period-s",
        type=float,
        default=d.routing_stats_period_s,
        help="how often each replica reports its load to the router",
    )
    group.add_argument(
        "--submit-timeout-s",
        type=float,
        default=d.submit_timeout_s,
        help="seconds the front waits for an engine replica to take a request",
    )
    group.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=d.engine_process,
        help="each replica's engine core in a process of its own, as under `rlt serve` "
        "(default: on a thread of the replica's process)",
    )


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    from rlt_ray.pd import PDOptions

    d = PDOptions()
    group = parser.add_argument_group("Ray PD (services/rlt-ray/README.md)")
    _add_placement_arguments(group, d)
    group.add_argument("--num-prefill", type=int, default=d.num_prefill, help="prefill replicas")
    group.add_argument("--num-decode", type=int, default=d.num_decode, help="decode replicas")
    group.add_argument(
        "--prefill-resource",
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="custom Ray resource each prefill replica needs (pin them to labelled nodes)",
    )
    group.add_argument(
        "--decode-resource",
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="custom Ray resource each decode replica needs",
    )
    for flag, default, what in (
        ("--prefill-credits", d.prefill_credits, "most requests in flight per prefill replica"),
        ("--decode-credits", d.decode_credits, "most requests in flight per decode replica"),
    ):
        group.add_argument(flag, type=int, default=default, help=what)
    for flag, default, what in (
        ("--admission-timeout", d.admission_timeout_s, "for a decode replica to admit a request"),
        ("--transfer-timeout", d.transfer_timeout_s, "from the prefill call to the first token"),
        ("--credit-wait", d.credit_wait_s, "a request waits for a free credit before HTTP 429"),
        ("--poll-interval", d.poll_interval_s, "between load / health polls of each replica"),
    ):
        group.add_argument(flag, type=float, default=default, help=f"seconds {what}")
    group.add_argument(
        "--discovery-period-s",
        type=float,
        default=d.discovery_period_s,
        help="how often replicas report their URL and load, and the ingress applies it",
    )
    group.add_argument(
        "--instance-api-key",
        default=os.environ.get("RLT_INSTANCE_API_KEY"),
        help="API key of the instances' HTTP servers (default: a random one)",
    )


def build_parser() -> argparse.ArgumentParser:
    from rlt.cli import add_serve_arguments
    from rlt_serve.option_flags import add_engine_flags

    parser = argparse.ArgumentParser(
        prog="rlt ray", description="Serve rlt engines as Ray Serve replicas."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="engine replicas behind one OpenAI-compatible endpoint"
    )
    pd = commands.add_parser("pd", help="prefill/decode disaggregation on Ray Serve")
    pd_serve = pd.add_subparsers(dest="pd_command", required=True).add_parser(
        "serve",
        help="prefill and decode replicas behind the PD coordinator's OpenAI-compatible front",
    )
    for sub in (serve, pd_serve):
        sub.add_argument(
            "model_dir",
            nargs="?",
            default=None,
            metavar="MODEL",
            help="checkpoint directory (every node must read it) or Hugging Face model id "
            "org/name (default: the bundled model)",
        )
        add_engine_flags(sub)
        add_serve_arguments(sub, exclude=("api_server_count",))
        _refuse_front_end_count(sub)
    add_ray_arguments(serve)
    add_pd_arguments(pd_serve)
    return explain_defaults(parser)  # every option's help shows its default


def _refuse_front_end_count(parser: argparse.ArgumentParser) -> None:
    """`rlt serve`'s --api-server-count does not apply here (--ingress-replicas scales the
    front): not in --help; given, it is refused with that advice."""
    parser.add_argument("--api-server-count", type=int, default=1, help=argparse.SUPPRESS)


def _resources(items: Sequence[str], flag: str = "replica_resource") -> dict[str, float]:
    resources = {}
    for item in items:
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name or value <= 0:
            raise ConfigurationError(flag, f"expected NAME=AMOUNT with AMOUNT > 0, got {item!r}")
        resources[name] = value
    return resources


def serve_options_from_args(args: argparse.Namespace):
    """rlt's ServeOptions (the front) from `rlt ray serve` / `rlt ray pd serve` flags; sets
    `args.model` from MODEL."""
    from rlt_serve.front_options import ServeOptions
    from rlt_serve.option_flags import options_from_args

    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        raise ConfigurationError("model", "give the model directory once (MODEL or --model)")
    args.model = args.model_dir if args.model_dir is not None else args.model
    if args.api_server_count != 1:
        raise ConfigurationError(
            "api_server_count", "rlt ray scales the front with --ingress-replicas instead"
        )
    if not args.route_prefix.startswith("/"):
        raise ConfigurationError("route_prefix", f"must start with '/', got {args.route_prefix!r}")
    if not args.app_name.strip():
        raise ConfigurationError("app_name", "must not be empty")
    options = build_options(ServeOptions, options_from_args(args, ServeOptions), what="server")
    return msgspec.structs.replace(options, front=_front_settings(args))


# vLLM's flags `rlt serve` takes that do not apply here: Ray Serve's HTTP proxy, not a uvicorn
# of rlt's, answers the requests, and the replicas and the ingress read the model directory's
# own tokenizer
NOT_UNDER_RAY = {
    "ssl_certfile": "TLS: terminate it in front of Ray Serve's proxy (a load balancer)",
    "ssl_keyfile": "TLS: terminate it in front of Ray Serve's proxy (a load balancer)",
    "uvicorn_log_level": "Ray Serve's proxy logs its own requests (RAY_SERVE_* settings)",
    "disable_log_requests": "Ray Serve's proxy logs its own requests (RAY_SERVE_* settings)",
    "tokenizer": "give a model directory that holds the tokenizer",
}


def _front_settings(args: argparse.Namespace):
    """--seed and --chat-template for the ingress's app (rlt_serve.vllm_flags); the flags of
    `rlt serve` that do not apply under Ray are refused, each with what to do instead."""
    from rlt_serve.vllm_flags import FrontSettings, check_model_arguments, read_chat_template

    for name, instead in NOT_UNDER_RAY.items():
        if getattr(args, name, None):
            flag = "--" + name.replace("_", "-")
            raise ConfigurationError(name, f"{flag} does not apply to rlt ray: {instead}")
    check_model_arguments(args)
    return FrontSettings(
        default_seed=args.seed, chat_template=read_chat_template(args.chat_template)
    )


def options_from_args(args: argparse.Namespace):
    """(EngineConfig, ServeOptions, RayOptions, address) from parsed `rlt ray serve` flags."""
    from rlt.cli import engine_config_from_args

    serve_options = serve_options_from_args(args)
    options = RayOptions(
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        autoscale_look_back_s=args.autoscale_look_back_s,
        upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        resources=_resources(args.replica_resource),
        max_replicas_per_node=args.max_replicas_per_node,
        router=args.router,
        load_factor=args.load_factor,
        load_slack=args.load_slack,
        max_ongoing_requests=args.max_ongoing_requests,
        ingress_replicas=args.ingress_replicas,
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=args.health_check_timeout_s,
        routing_stats_period_s=args.routing_stats_period_s,
        submit_timeout_s=args.submit_timeout_s,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        engine_process=args.engine_process,
    )
    options.validate()
    return engine_config_from_args(args), serve_options, options, args.address


def pd_options_from_args(args: argparse.Namespace):
    """(EngineConfig, ServeOptions, PDOptions, address) from parsed `rlt ray pd serve` flags."""
    from rlt.cli import engine_config_from_args

    from rlt_ray.pd import PDOptions

    serve_options = serve_options_from_args(args)
    options = PDOptions(
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        prefill_resources=_resources(args.prefill_resource, "prefill_resource"),
        decode_resources=_resources(args.decode_resource, "decode_resource"),
        max_replicas_per_node=args.max_replicas_per_node,
        prefill_credits=args.prefill_credits,
        decode_credits=args.decode_credits,
        admission_timeout_s=args.admission_timeout,
        transfer_timeout_s=args.transfer_timeout,
        credit_wait_s=args.credit_wait,
        poll_interval_s=args.poll_interval,
        discovery_period_s=args.discovery_period_s,
        instance_api_key=args.instance_api_key or None,
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=args.health_check_timeout_s,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
    )
    options.validate()
    return engine_config_from_args(args), serve_options, options, args.address


def placement_from_args(args: argparse.Namespace, ingress_replicas: int):
    from rlt_ray.runner import Placement

    return Placement(args.address, args.app_name, args.route_prefix, ingress_replicas)


def run_serve(args: argparse.Namespace, signals) -> int:
    from rlt_ray.app import build_app
    from rlt_ray.runner import check_local_model, run_app

    config, serve_options, options, _ = options_from_args(args)
    config = check_local_model(config, args.address)
    line = f"{_replica_line(options)}, router {options.router}"
    return run_app(
        lambda key: build_app(config, serve_options, options, drain_key=key),
        serve_options,
        placement_from_args(args, options.ingress_replicas),
        line,
        signals,
    )


def run_pd_serve(args: argparse.Namespace, signals) -> int:
    from rlt_ray.pd import build_pd_app
    from rlt_ray.runner import check_local_model, run_app

    config, serve_options, options, _ = pd_options_from_args(args)
    config = check_local_model(config, args.address)
    line = f"{options.num_prefill} prefill + {options.num_decode} decode replicas"
    return run_app(
        lambda key: build_pd_app(config, serve_options, options, drain_key=key),
        serve_options,
        placement_from_args(args, 1),
        line,
        signals,
    )


def _replica_line(options: RayOptions) -> str:
    if options.autoscaling:
        return f"{options.min_replicas}-{options.max_replicas} engine replicas, autoscaled"
    return f"{options.replicas} engine replica{'s' if options.replicas != 1 else ''}"


def main(argv: Sequence[str] | None = None) -> int:
    """`rlt ray ...`; SIGINT / SIGTERM follow rlt's one policy from the start (a signal
    before anything started exits 0 at once: `rlt_ray.runner` for the rest)."""
    signals = StopSignals().install()
    try:
        set_ray_environment_defaults()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parse_command_line(build_parser(), argv)  # errors: the subcommand's usage
        run = run_pd_serve if args.command == "pd" else run_serve
        return run(args, signals)
    except StopRequested as stop:
        print(f"rlt ray: {signal_name(stop.signum)} during start-up: stopping", flush=True)
        return EXIT_OK
    except (ClusterStartError, AppStartError) as exc:
        print(f"rlt ray: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except RltError as exc:
        print(f"rlt ray: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        signals.finish()


if __name__ == "__main__":
    sys.exit(main())
