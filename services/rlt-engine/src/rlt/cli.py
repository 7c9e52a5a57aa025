"""The `rlt` command: `rlt generate PROMPT ...`, `rlt serve [MODEL_DIR]`, `rlt bench serve`,
`rlt pd serve` (the PD coordinator, rlt_pd_coordinator.cli) and `rlt ray serve` (Ray Serve,
rlt_ray.cli, found through the `rlt.commands` entry point: rlt does not depend on Ray)."""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import signal
import sys
from collections.abc import Collection, Sequence

from msgspec.structs import replace
from rlt_contracts import DEFAULT_GATE_EXIT_THRESHOLD, RltError, SamplingParams, build_options
from rlt_serve import LoopDefaults
from rlt_serve.cli_help import explain_defaults, parse_command_line
from rlt_serve.exit_codes import EXIT_USAGE
from rlt_serve.front_options import ServeOptions
from rlt_serve.listening import check_can_listen
from rlt_serve.option_flags import (
    add_engine_flags,
    add_option_flags,
    engine_options_from_args,
    options_from_args,
)
from rlt_serve.vllm_flags import (
    add_front_arguments,
    check_model_arguments,
    front_settings_from_args,
)

from rlt.engine.config import EngineConfig


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine options a command's flags give (the rest keep their defaults)."""
    return EngineConfig.from_options(**engine_options_from_args(args))


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    group = parser.add_argument_group("sampling and loops")
    group.add_argument(
        "--max-tokens", type=int, default=48, help="tokens to generate per prompt, at most"
    )
    # rlt generate samples greedily unless told otherwise (as SamplingParams() in Python);
    # HTTP requests that omit temperature get 1.0, OpenAI's default (docs/configuration.md)
    group.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="0 is greedy; > 0 samples (default: 0 here and in SamplingParams; 1.0 for HTTP "
        "requests that omit it, as in OpenAI's API)",
    )
    group.add_argument(
        "--top-p", type=float, default=d.top_p, help="nucleus mass kept; 1 keeps every token"
    )
    group.add_argument(
        "--top-k", type=int, default=d.top_k, help="most likely tokens kept; -1 keeps every token"
    )
    group.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of each prompt's random stream: sampled output repeats run to run",
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )


def sampling_params_from_args(args: argparse.Namespace, exit_signal: str) -> SamplingParams:
    """The command line's request; an unset --exit-threshold is the model's own default
    (`LoopDefaults.for_model`)."""
    threshold = args.exit_threshold
    if threshold is None:
        threshold = DEFAULT_GATE_EXIT_THRESHOLD if exit_signal == "gate" else 1.0
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        exit_threshold=threshold,
    )


def check_model_sources(args: argparse.Namespace) -> None:
    """Before anything loads: vLLM's model flags (rlt_serve.vllm_flags), and what the model
    directory lacks (with --tokenizer, that directory holds the tokenizer instead)."""
    from rlt_models.model_source import resolve_tokenizer_dir

    from rlt.engine.assembly import resolve_model_dir

    check_model_arguments(args)
    separate_tokenizer = resolve_tokenizer_dir(args.tokenizer) is not None
    resolve_model_dir(args.model, tokenizer=not separate_tokenizer)


def resolve_model_argument(args: argparse.Namespace) -> None:
    """Before anything loads: a Hugging Face model id given as the model (or as --tokenizer)
    becomes its snapshot directory in the Hugging Face cache, found there or downloaded now
    with progress (rlt_models.model_source; --revision pinned to the snapshot's commit), so
    that every process of the command reads that one directory; the servers still call the
    model by its id (a snapshot's path names it). An id that cannot be resolved fails here in
    one line, before torch is imported."""
    from rlt_models.model_source import resolve_model_source, tokenizer_snapshot

    if args.model is None and args.revision is not None:
        from rlt_contracts import ConfigurationError

        raise ConfigurationError(
            ("revision", "model"),
            "a revision picks a snapshot of a Hugging Face model id; give the id",
        )
    if args.model is not None:
        source = resolve_model_source(
            args.model, revision=args.revision, download_dir=args.download_dir
        )
        args.model, args.revision = str(source.local_dir), None
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None:
        snapshot = tokenizer_snapshot(tokenizer, download_dir=args.download_dir)
        args.tokenizer = tokenizer if snapshot is None else str(snapshot)


def run_generate(args: argparse.Namespace) -> int:
    resolve_model_argument(args)  # a Hub id: found or downloaded, before anything loads
    from rlt.llm import LLM

    check_model_sources(args)
    llm = LLM.from_config(engine_config_from_args(args))
    params = sampling_params_from_args(args, llm.engine.model_info().exit_signal)
    # a progress bar (requests, tokens) on a terminal; none in a pipe or a log file
    outputs = llm.generate(args.prompts, params, use_tqdm=sys.stderr.isatty())
    stats = llm.get_stats()
    for prompt, output in zip(args.prompts, outputs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "request_id": output.request_id,
                        "prompt_token_ids": output.prompt_token_ids,
                        "token_ids": output.token_ids,
                        "text": output.text,
                        "exit_depths": output.exit_depths,
                        "finish_reason": str(output.finish_reason),
                    }
                )
            )
            continue
        print(prompt + output.text)
        print(f"exit depths: {' '.join(map(str, output.exit_depths))}")
        print(
            f"mean loops per decoded token: {output.mean_loops:.2f}  "
            f"(finish: {output.finish_reason}, {len(output.token_ids)} tokens)"
        )
    if stats.spec_drafts and not args.json:
        print(speculation_summary(stats))
    return 0


def speculation_summary(stats) -> str:
    """One line of draft acceptance (EngineStats' spec_* counters)."""
    per_position = ", ".join(
        f"{accepted / stats.spec_drafts:.2f}" for accepted in stats.spec_accepted_per_position
    )
    return (
        f"speculation: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafts "
        f"accepted ({stats.spec_acceptance_rate:.1%}), mean accepted length "
        f"{stats.spec_mean_accepted_length:.2f} tokens per round; acceptance by position: "
        f"{per_position}"
    )


def add_serve_arguments(parser: argparse.ArgumentParser, *, exclude: Collection[str] = ()) -> None:
    """The server's options (`ServeOptions`, with its loop defaults) and vLLM's front flags."""
    add_option_flags(parser, ServeOptions, exclude=exclude)
    add_front_arguments(parser.add_argument_group("server: flags from vLLM (docs/serving.md)"))


def run_serve(args: argparse.Namespace) -> int:
    # OpenMP workers that spin between parallel regions burn a core each in every idle
    # process of a server group (its engine cores, PD instances); they wait passively unless
    # the user says otherwise. Read once, when torch loads OpenMP: so before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rlt_serve.shutdown import StopRequested, StopSignals, exit_at_once

    # the stop-signal policy of every rlt server, before anything starts: a SIGINT / SIGTERM
    # during start-up stops it cleanly (exit 0), one while serving drains (rlt_serve.shutdown)
    signals = StopSignals().install()
    started: list = []  # a core spawned before the server's imports
    try:
        with signals.acting(exit_at_once(signals, lambda: [core.kill() for core in started])):
            config, options, core = _prepare_serving(args, signals, started)
            from rlt.serving.server import serve
        return serve(config, options, core=core, signals=signals)
    except StopRequested:
        for core in started:  # (serve() kills it; unless the signal came before it could)
            core.kill()
        return signals.exit_code()
    finally:
        signals.finish()


def _prepare_serving(args: argparse.Namespace, signals, started: list):
    """(engine config, serve options, the core if it is spawned before the server's imports);
    `started` gets that core."""
    from rlt_contracts import ConfigurationError

    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        raise ConfigurationError("model", "give the model directory once (MODEL_DIR or --model)")
    args.model = args.model_dir if args.model_dir is not None else args.model
    resolve_model_argument(args)  # a Hub id: found or downloaded, before torch is imported
    from rlt.engine.assembly import resolve_model_dir

    if args.model is None:
        try:
            resolve_model_dir(None)
        except ConfigurationError as exc:
            raise ConfigurationError(
                "model", f"{exc.message}; pass a checkpoint directory: rlt serve MODEL_DIR"
            ) from None
    options = build_options(ServeOptions, options_from_args(args, ServeOptions), what="server")
    check_model_sources(args)  # before anything loads: what the model directory lacks
    front = front_settings_from_args(args)  # the chat template read, TLS files loaded
    check_can_listen(options.host, options.port)  # a taken port fails now, not after loading
    options = replace(options, front=front)
    config = engine_config_from_args(args)
    core = None
    from rlt.serving.core_process_client import CoreProcess, child_start_method

    if options.api_server_count == 1 and child_start_method(config) == "spawn":
        # a spawned core (CUDA) imports everything itself: start it now, so it builds while
        # this process imports its server parts; a forked one (CPU) starts after them and
        # inherits them instead of importing them a second time
        with signals.spawning():
            core = CoreProcess.spawn(config, log_level=options.log_level)
            started.append(core)
    return config, options, core


def build_parser() -> argparse.ArgumentParser:
    from rlt.versions import VersionsAction

    parser = argparse.ArgumentParser(
        prog="rlt", description="Serve and run recurrent looped transformers."
    )
    parser.add_argument("--version", action=VersionsAction)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+", help="prompt text (several prompts are batched)")
    generate.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per prompt instead of text (default: off, the text and its "
        "exit depths)",
    )
    add_engine_flags(generate)
    add_sampling_arguments(generate)
    add_option_flags(generate, LoopDefaults)
    generate.set_defaults(handler=run_generate)
    serve = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="checkpoint directory (default: the bundled model)",
    )
    add_engine_flags(serve, exclude=())  # --pd-role too: an instance's role
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_serve)
    commands.add_parser(
        "pd",
        help="prefill/decode disaggregated serving: `rlt pd serve --help`",
        add_help=False,
    )
    commands.add_parser(
        "ray",
        help="engine replicas on a Ray cluster (needs rlt-ray): `rlt ray serve --help`",
        add_help=False,
    )
    from rlt.bench.cli import add_bench_parser

    add_bench_parser(commands)
    return explain_defaults(parser)  # every option's help shows its default (rlt_serve.cli_help)


def _enable_stack_dumps() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr (a busy or stuck server)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass  # no SIGUSR1 (Windows) or a stderr without a file descriptor (captured output)


def _plugin_command(name: str, argv: list[str]) -> int:
    """`rlt NAME ...` provided by another distribution through the `rlt.commands` entry point
    group (rlt-ray's `ray`): rlt cannot depend on it, since it depends on rlt."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="rlt.commands", name=name))
    if not found:
        print(
            f"rlt: error: `rlt {name}` is provided by rlt-{name}, which is not installed",
            file=sys.stderr,
        )
        return 2
    return found[0].load()(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _enable_stack_dumps()
    if argv[:1] == ["pd"]:  # the coordinator parses its own command line
        from rlt_pd_coordinator.cli import main as pd_main

        return pd_main(argv[1:])
    if argv[:1] == ["ray"]:  # Ray Serve: the optional rlt-ray distribution's plug-in
        return _plugin_command("ray", argv[1:])
    # an unknown flag is reported with its subcommand's usage
    args = parse_command_line(build_parser(), argv)
    try:
        return args.handler(args)
    except RltError as exc:
        print(f"rlt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
