"""`rlt ray serve [MODEL] ...` and `rlt ray pd serve [MODEL] ...` (also `rlt-ray ...` and
`python -m rlt_ray ...`).

The engine and HTTP flags are `rlt serve`'s own (rlt.cli; not `--api-server-count`:
`--ingress-replicas` scales the front); the Ray flags, the fields of `RayOptions` (`serve`:
how many replicas, where they run and how requests are routed) or `PDOptions` (`pd serve`: how
many prefill and decode replicas run where, the coordinator's credits and timeouts), are
generated and read back by `rlt_serve.option_flags`. Which cluster, the start, the drain and
the exit: `rlt_ray.runner`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import msgspec
from rlt_contracts import ConfigurationError, RltError, build_options
from rlt_serve.cli_help import explain_defaults, parse_command_line
from rlt_serve.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from rlt_serve.shutdown import StopRequested, StopSignals, signal_name

from rlt_ray.app import RayOptions
from rlt_ray.local_cluster import ClusterStartError
from rlt_ray.runner import (
    THROUGHPUT_OPTIMIZED_ENV,  # noqa: F401 - documented here too (tests, `rlt ray` users)
    AppStartError,
    set_ray_environment_defaults,
)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from rlt.cli import add_serve_arguments
    from rlt_serve.option_flags import add_engine_flags, add_option_flags

    from rlt_ray.pd import PDOptions

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
    add_option_flags(serve, RayOptions)
    add_option_flags(pd_serve, PDOptions)
    return explain_defaults(parser)  # every option's help shows its default


def _refuse_front_end_count(parser: argparse.ArgumentParser) -> None:
    """`rlt serve`'s --api-server-count does not apply here (--ingress-replicas scales the
    front): not in --help; given, it is refused with that advice."""
    parser.add_argument("--api-server-count", type=int, default=1, help=argparse.SUPPRESS)


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
    """(EngineConfig, ServeOptions, RayOptions or, for `pd serve`, PDOptions, address) from
    parsed flags; the Ray options' replicas' shutdown grace is --shutdown-timeout."""
    from rlt.cli import engine_config_from_args
    from rlt_serve.option_flags import options_from_args as flag_options

    from rlt_ray.pd import PDOptions

    root = PDOptions if args.command == "pd" else RayOptions
    serve_options = serve_options_from_args(args)
    options = build_options(root, flag_options(args, root), what="Ray")
    options = msgspec.structs.replace(options, graceful_shutdown_timeout_s=args.shutdown_timeout)
    options.validate()
    return engine_config_from_args(args), serve_options, options, args.address


def placement_from_args(args: argparse.Namespace, ingress_replicas: int):
    from rlt_ray.runner import Placement

    return Placement(args.address, args.app_name, args.route_prefix, ingress_replicas)


def run_serve(args: argparse.Namespace, signals) -> int:
    """`rlt ray serve`, or `rlt ray pd serve` (`args.command` "pd"): its app under the
    command's life (`rlt_ray.runner.run_app`: the cluster, the URL, the drain on signals)."""
    from rlt_ray.runner import check_local_model, run_app

    config, serve_options, options, _ = options_from_args(args)
    config = check_local_model(config, args.address)
    if args.command == "pd":
        from rlt_ray.pd import build_pd_app as build

        line = f"{options.num_prefill} prefill + {options.num_decode} decode replicas"
        ingress_replicas = 1
    else:
        from rlt_ray.app import build_app as build

        line = f"{_replica_line(options)}, router {options.router}"
        ingress_replicas = options.ingress_replicas
    return run_app(
        lambda key: build(config, serve_options, options, drain_key=key),
        serve_options,
        placement_from_args(args, ingress_replicas),
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
        return run_serve(args, signals)
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
