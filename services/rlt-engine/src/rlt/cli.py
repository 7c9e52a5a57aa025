"""The `rlt` command: `rlt generate PROMPT ...` (and `rlt serve` once the server exists)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rlt_contracts import RltError, SamplingParams

from rlt.engine.config import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options as --kebab-case flags; defaults come from EngineConfig."""
    d = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    group.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    group.add_argument("--kv-layout", default=d.kv_layout, choices=["last_exited", "shared"])
    group.add_argument("--scheduling-mode", default=d.scheduling_mode, choices=["refill", "no_refill"])
    group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    group.add_argument("--prefill-chunk-size", type=int, default=d.prefill_chunk_size)
    group.add_argument("--block-size", type=int, default=d.block_size)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--attention-backend", default=d.attention_backend)
    group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_layout=args.kv_layout,
        scheduling_mode=args.scheduling_mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    group = parser.add_argument_group("sampling and loops")
    group.add_argument("--max-tokens", type=int, default=48)
    group.add_argument("--temperature", type=float, default=d.temperature)
    group.add_argument("--top-p", type=float, default=d.top_p)
    group.add_argument("--top-k", type=int, default=d.top_k)
    group.add_argument("--seed", type=int, default=d.seed)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--min-loops", type=int, default=d.min_loops)
    group.add_argument("--max-loops", type=int, default=None)
    group.add_argument("--exit-threshold", type=float, default=0.7,
                       help="exit once the gate's cumulative probability reaches this (1.0 = fixed depth)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
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
        exit_threshold=args.exit_threshold,
    )


def run_generate(args: argparse.Namespace) -> int:
    from rlt.llm import LLM

    llm = LLM.from_config(engine_config_from_args(args))
    params = sampling_params_from_args(args)
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for output in outputs:
        if args.json:
            print(json.dumps({
                "request_id": output.request_id,
                "prompt_token_ids": output.prompt_token_ids,
                "token_ids": output.token_ids,
                "text": output.text,
                "exit_depths": output.exit_depths,
                "finish_reason": str(output.finish_reason),
            }))
            continue
        print(output.text)
        print(f"exit depths: {' '.join(map(str, output.exit_depths))}")
        print(f"mean loops per decoded token: {output.mean_loops:.2f}  "
              f"(finish: {output.finish_reason}, {len(output.token_ids)} tokens)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt", description="Serve and run recurrent looped transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+", help="prompt text (several prompts are batched)")
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(generate)
    add_sampling_arguments(generate)
    generate.set_defaults(handler=run_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except RltError as exc:
        print(f"rlt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
