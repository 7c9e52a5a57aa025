"""`rlt pd serve`: the PD coordinator (or the plain router) with its OpenAI-compatible front.

    rlt pd serve [MODEL] --num-prefill N --num-decode M [options] [engine flags]
    rlt pd serve [MODEL] --prefill-url URL ... --decode-url URL ... [options]
    rlt pd serve [MODEL] --replicas N | --url URL ... [options]       (plain router baseline)

MODEL (default: the engine's bundled model) comes right after `serve`, or as --model: a
checkpoint directory or a Hugging Face model id (found in the Hugging Face cache or downloaded
into it by the coordinator, whose instances then load that snapshot). The engine flags are
`rlt serve`'s (rlt_serve.option_flags; not --pd-role, which the coordinator assigns, and
--device, which lists the local instances' devices here): checked here, then passed verbatim
to every local instance's `rlt serve`. A flag this command does not know is refused with its
usage (exit 2), unless --engine-command names another command than `rlt serve`: then it is
passed to that command. The coordinator's own flags are the fields of `CoordinatorOptions`
(and of its `coordination`, rlt ray pd serve's too), generated the same way.

Also runs as `python -m rlt_pd_coordinator serve ...` (a leading `pd` is accepted too).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from collections.abc import Sequence

import msgspec
from rlt_contracts import ConfigurationError, RltError, build_options, option_fields
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

from rlt_pd_coordinator.options import CoordinatorOptions
from rlt_pd_coordinator.server import run
from rlt_pd_coordinator.supervisor import DEFAULT_COMMAND, StartupError

PROG = "rlt pd"


# engine options the coordinator reads itself: it resolves the model and --tokenizer (a Hub id
# once, server.py), the front uses both, and the instances get their directories
CONSUMED_ENGINE_OPTIONS = ("model", "revision", "download_dir", "tokenizer")
FRONT_OPTIONS = frozenset(f.name for f in option_fields(FrontOptions))


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
    """The coordinator's flags (`CoordinatorOptions`: the instances, then the credits and
    timeouts of `CoordinationOptions`), then the front's, as rlt serve's."""
    add_option_flags(parser, CoordinatorOptions, exclude=FRONT_OPTIONS)
    add_option_flags(parser, FrontOptions)
    add_front_arguments(parser.add_argument_group("server: flags from vLLM (docs/serving.md)"))


def split_model(argv: list[str]) -> tuple[str | None, list[str]]:
    """MODEL is the token right after `serve` when it is not a flag."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def options_from_args(
    args: argparse.Namespace, model: str | None, engine_args: list[str]
) -> CoordinatorOptions:
    """The options the flags give, and what the coordinator derives from them: MODEL, the
    mode, the instances' key, --device's comma-separated lists, the engine flags."""
    if model is not None and args.model is not None and model != args.model:
        raise ConfigurationError("model", "give the model directory once (MODEL or --model)")
    flags = flag_options(args, CoordinatorOptions)
    options = build_options(CoordinatorOptions, flags, what="server")
    local = options.num_prefill + options.num_decode + options.replicas
    instance_key = args.instance_api_key or args.api_key
    if instance_key is None and local:
        instance_key = secrets.token_urlsafe(24)  # only the coordinator talks to them
    if not options.command:
        raise ConfigurationError("engine_command", "must not be empty")
    check_model_arguments(args)
    return msgspec.structs.replace(
        options,
        model=model if model is not None else args.model,
        revision=args.revision,
        download_dir=args.download_dir,
        mode="router" if options.replicas or options.replica_urls else "pd",
        instance_api_key=instance_key,
        engine_args=tuple(engine_args),
        devices=tuple(
            d.strip() for value in options.devices for d in value.split(",") if d.strip()
        ),
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
    serve = parser.get_default("serve_parser")
    args, unknown = serve.parse_known_args(rest)  # every flag checked
    if unknown and tuple(args.engine_command) == DEFAULT_COMMAND:
        # every flag of rlt serve is declared here: an unknown one is a mistake (exit 2)
        serve.error(f"unrecognized arguments: {' '.join(unknown)}")
    coordinator_only = build_parser(engine_flags=False).get_default("serve_parser")
    # the engine flags, and those only another --engine-command may know
    _, engine_args = coordinator_only.parse_known_args(rest)
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
