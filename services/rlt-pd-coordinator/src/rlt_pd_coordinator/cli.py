"""`rlt pd serve`: the PD coordinator (or the plain router) with its OpenAI-compatible front.

    rlt pd serve [MODEL] --num-prefill N --num-decode M [options] [engine flags]
    rlt pd serve [MODEL] --prefill-url URL ... --decode-url URL ... [options]
    rlt pd serve [MODEL] --replicas N | --url URL ... [options]       (plain router baseline)

MODEL (default: the engine's bundled model) comes right after `serve`, or as --model: a
checkpoint directory or a Hugging Face model id (found in the Hugging Face cache or downloaded
into it by the coordinator, whose instances then load that snapshot). The engine flags are
`rlt serve`'s (rlt_serve.option_flags; not --pd-role, which the coordinator assigns, and
--device, which lists the local instances' devices here): checked here, then passed verbatim
to every local instance's `rlt serve`, as is any flag this command does not know.

Also runs as `python -m rlt_pd_coordinator serve ...` (a leading `pd` is accepted too).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import sys
from collections.abc import Sequence

import msgspec
from rlt_contracts import ConfigurationError, RltError, build_options
from rlt_serve.cli_help import explain_defaults, parse_command_line
from rlt_serve.exit_codes import EXIT_FAILURE, EXIT_USAGE
from rlt_serve.front_options import FrontOptions
from rlt_serve.option_flags import INSTANCE_ONLY, add_engine_flags, add_option_flags
from rlt_serve.option_flags import options_from_args as flag_options
from rlt_serve.vllm_flags import (
    add_front_arguments,
    check_model_arguments,
    front_settings_from_args,
)

from rlt_pd_coordinator.client import Timeouts
from rlt_pd_coordinator.server import CoordinatorOptions, run
from rlt_pd_coordinator.supervisor import DEFAULT_COMMAND, StartupError

PROG = "rlt pd"


# engine options the coordinator reads itself (it resolves the model; the instances get MODEL,
# and --tokenizer, which the front uses too)
CONSUMED_ENGINE_OPTIONS = ("model", "revision", "download_dir", "tokenizer")


def build_parser(*, engine_flags: bool = True) -> argparse.ArgumentParser:
    """`engine_flags`: every engine flag (else only those the coordinator reads itself)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Prefill/decode disaggregated serving: a coordinator with an "
        "OpenAI-compatible front over prefill and decode engine instances.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible API over prefill/decode instances or replicas",
        usage=f"{PROG} serve [MODEL] [options] [engine flags]",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_serve_arguments(serve)
    if engine_flags:
        add_engine_flags(serve, exclude=(*INSTANCE_ONLY, "device"))
    else:
        add_engine_flags(serve, only=CONSUMED_ENGINE_OPTIONS)
    parser.set_defaults(serve_parser=serve)
    return explain_defaults(parser)  # every option's help shows its default


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CoordinatorOptions()
    pd = parser.add_argument_group("prefill/decode instances")
    pd.add_argument("--num-prefill", type=int, default=0, help="local prefill instances to start")
    pd.add_argument("--num-decode", type=int, default=0, help="local decode instances to start")
    pd.add_argument(
        "--prefill-url",
        action="append",
        default=[],
        metavar="URL",
        help="a running prefill instance (`rlt serve --pd-role prefill`; repeatable)",
    )
    pd.add_argument(
        "--decode-url",
        action="append",
        default=[],
        metavar="URL",
        help="a running decode instance (`rlt serve --pd-role decode`; repeatable)",
    )
    pd.add_argument(
        "--prefill-credits",
        type=int,
        default=defaults.prefill_credits,
        help="most requests in flight per prefill instance",
    )
    pd.add_argument(
        "--decode-credits",
        type=int,
        default=defaults.decode_credits,
        help="most requests in flight per decode instance",
    )
    router = parser.add_argument_group("plain router (the colocated baseline)")
    router.add_argument(
        "--replicas", type=int, default=0, help="local whole-engine replicas to start"
    )
    router.add_argument(
        "--url",
        "--replica-url",
        dest="replica_url",
        action="append",
        default=[],
        metavar="URL",
        help="a running colocated instance (`rlt serve`; repeatable)",
    )
    router.add_argument(
        "--replica-credits",
        type=int,
        default=defaults.replica_credits,
        help="most requests in flight per replica",
    )

    local = parser.add_argument_group("local instances")
    local.add_argument(
        "--device",
        action="append",
        default=[],
        help="device of the local instances; several (comma-separated or repeated) are "
        "assigned round-robin: prefill instances first, then decode, then replicas",
    )
    local.add_argument(
        "--engine-command",
        default=None,
        help="command that runs one instance, MODEL and flags appended "
        f"(default: {' '.join(DEFAULT_COMMAND[1:])} with this Python)",
    )
    local.add_argument(
        "--instance-log-level",
        default=defaults.instance_log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="--log-level of the local instances",
    )
    local.add_argument(
        "--restart-delay",
        type=float,
        default=defaults.restart_delay,
        help="seconds before restarting an instance that died (doubling on repeated "
        "failures, up to 30 s)",
    )
    local.add_argument(
        "--startup-timeout",
        type=float,
        default=defaults.startup_timeout,
        help="seconds an instance may take to answer /health",
    )

    timing = parser.add_argument_group("instances and timeouts")
    timing.add_argument(
        "--instance-api-key",
        default=os.environ.get("RLT_INSTANCE_API_KEY"),
        help="API key of the instances (default: $RLT_INSTANCE_API_KEY, else --api-key; "
        "local instances get a random one when neither is set)",
    )
    timing.add_argument(
        "--admission-timeout",
        type=float,
        default=defaults.timeouts.admission,
        help="seconds for a decode instance to admit a request (its handoff target)",
    )
    timing.add_argument(
        "--transfer-timeout",
        type=float,
        default=defaults.timeouts.transfer,
        help="seconds from the prefill call to the decode instance's first token",
    )
    timing.add_argument(
        "--credit-wait",
        type=float,
        default=defaults.credit_wait,
        help="seconds a request waits for a free credit before HTTP 429",
    )
    timing.add_argument(
        "--connect-timeout",
        type=float,
        default=defaults.connect_timeout,
        help="seconds to connect to an instance",
    )
    timing.add_argument(
        "--poll-interval",
        type=float,
        default=defaults.poll_interval,
        help="seconds between load / health polls of each instance",
    )

    add_option_flags(parser, FrontOptions)  # the front's, as rlt serve's
    add_front_arguments(parser.add_argument_group("server: flags from vLLM (docs/serving.md)"))


def split_model(argv: list[str]) -> tuple[str | None, list[str]]:
    """MODEL is the token right after `serve` when it is not a flag."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def options_from_args(
    args: argparse.Namespace, model: str | None, engine_args: list[str]
) -> CoordinatorOptions:
    if model is not None and args.model is not None and model != args.model:
        raise ConfigurationError("model", "give the model directory once (MODEL or --model)")
    devices = tuple(d.strip() for value in args.device for d in value.split(",") if d.strip())
    local = args.num_prefill + args.num_decode + args.replicas
    instance_key = args.instance_api_key or args.api_key
    if instance_key is None and local:
        instance_key = secrets.token_urlsafe(24)  # only the coordinator talks to them
    router = bool(args.replicas or args.replica_url)
    command = tuple(shlex.split(args.engine_command)) if args.engine_command else DEFAULT_COMMAND
    if not command:
        raise ConfigurationError("engine_command", "must not be empty")
    check_model_arguments(args)
    if args.tokenizer is not None and local:  # the instances detokenize with it too
        engine_args = [*engine_args, "--tokenizer", args.tokenizer]
    front = flag_options(args, FrontOptions)
    options = build_options(CoordinatorOptions, front, what="server")
    return msgspec.structs.replace(
        options,
        model=model if model is not None else args.model,
        revision=args.revision,
        download_dir=args.download_dir,
        mode="router" if router else "pd",
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        replicas=args.replicas,
        prefill_urls=tuple(args.prefill_url),
        decode_urls=tuple(args.decode_url),
        replica_urls=tuple(args.replica_url),
        prefill_credits=args.prefill_credits,
        decode_credits=args.decode_credits,
        replica_credits=args.replica_credits,
        instance_api_key=instance_key,
        timeouts=Timeouts(admission=args.admission_timeout, transfer=args.transfer_timeout),
        connect_timeout=args.connect_timeout,
        poll_interval=args.poll_interval,
        credit_wait=args.credit_wait,
        command=command,
        engine_args=tuple(engine_args),
        devices=devices,
        instance_log_level=args.instance_log_level,
        startup_timeout=args.startup_timeout,
        restart_delay=args.restart_delay,
        tokenizer=args.tokenizer,
        front=front_settings_from_args(args),
    )


def parse(argv: Sequence[str]) -> CoordinatorOptions:
    """Options of `serve ...` (argv without the program name; a leading `pd` is dropped)."""
    argv = list(argv)
    if argv[:1] == ["pd"]:
        argv = argv[1:]
    parser = build_parser()
    if argv[:1] != ["serve"]:
        parse_command_line(parser, argv)  # prints usage / help, or the error, and exits
        parser.error("expected the `serve` command")
    model, rest = split_model(argv[1:])
    args, _ = parser.get_default("serve_parser").parse_known_args(rest)  # every flag checked
    coordinator_only = build_parser(engine_flags=False).get_default("serve_parser")
    _, engine_args = coordinator_only.parse_known_args(rest)  # engine and unknown flags
    return options_from_args(args, model, engine_args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options = parse(argv)
        logging.basicConfig(
            level=options.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal call
        return run(options)
    except StartupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except RltError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
