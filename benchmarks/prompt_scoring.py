"""Prompt scoring at full depth and at each position's exit depth (issue 25): its throughput
against plain prefill, and with --heldout what exiting early does to perplexity.

One engine (prefix caching on), arms over the same prompts, each after a warm-up:
  prefill        max_tokens 1: what serving computes for these prompts (random prompts only)
  full_depth     prompt_logprobs: every prompt token scored at full depth
  exit_depth@T   prompt_logprobs + score_at_exit_depth at threshold T (each of --thresholds,
                 min_loops --min-loops): each token's log-probability comes from the loop where
                 the exit rule fires for its position, as a teacher-forced decode would give it
                 (eager, position-major loops)
Prompts: Q questions (--questions), each a shared context of --context-len random tokens and C
choices (--choices) of --choice-len tokens, sent as evaluation harnesses send multiple choice
(one request per choice, a question's choices at once: the first computes the context, the
others wait for its pages and scores, rlt-scheduler's prefix waits, and reuse them); or with
--heldout the bundled model's held-out passages (benchmarks/data/heldout_passages.json, never
trained on; prompt_logprobs 0). Per arm: prompt tokens / second (wall clock) and the ratio to
the first arm; with --heldout also the perplexity over every scored token, the mean loops per
token and the depth histogram (full depth: every token runs all T loops).

    python3 benchmarks/prompt_scoring.py --shape ouro-1.4b --device cuda --dtype bfloat16 \\
        --out results.json                                      # tools/h200_run.sh scoring
    uv run python benchmarks/prompt_scoring.py --heldout --thresholds 0.5,0.7,0.9 \\
        --min-loops 1 --out exit_depth_quality.json             # docs/evaluation.md's table
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter

from harness import floats, parser, record, sync, write_json
from workload import SHAPE_NAMES, ensure_checkpoint, heldout_passages


def random_choices(args, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(args.questions):
        context = [rng.randrange(vocab) for _ in range(args.context_len)]
        for _ in range(args.choices):
            prompts.append(context + [rng.randrange(vocab) for _ in range(args.choice_len)])
    return prompts


def run_arm(engine, prompts, params, device: str) -> tuple[float, dict]:
    """Wall seconds for every prompt, and each request's output by index."""
    start, tag = time.perf_counter(), time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}-{tag}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[int(output.request_id[1:].split("-")[0])] = output
    sync(device)
    return time.perf_counter() - start, done


def quality(outputs: dict, loops: int) -> dict:
    logprobs, depths = [], []
    for _, output in sorted(outputs.items()):
        logprobs += output.prompt_logprobs[1:]
        if output.prompt_exit_depths is not None:
            depths += output.prompt_exit_depths[1:]
    depths = depths or [loops] * len(logprobs)
    return {
        "tokens": len(logprobs),
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "mean_loops_per_token": sum(depths) / len(depths),
        "depth_histogram": dict(sorted(Counter(depths).items())),
    }


def main(argv=None) -> None:
    p = parser(__doc__, device="cpu", dtype="float32")
    p.add_argument("--shape", default="tiny", choices=SHAPE_NAMES)
    p.add_argument("--model", default=None, help="checkpoint (--heldout: the bundled model)")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--heldout", action="store_true", help="the bundled model's passages")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-len", type=int, default=1000)
    p.add_argument("--choice-len", type=int, default=24)
    p.add_argument("--thresholds", default="0.5")
    p.add_argument("--min-loops", type=int, default=None, help="default: the model's")
    args = p.parse_args(argv)
    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    model = args.model
    if not args.heldout:
        model = ensure_checkpoint(args.shape, args.checkpoint_dir, args.device, args.model)
    engine = LLMEngine(
        EngineConfig.from_options(
            model=model, device=args.device, dtype=args.dtype, enable_prefix_caching=True
        )
    )
    if args.heldout:
        encode = engine.tokenizer
        prompts = [encode(t, add_special_tokens=False).input_ids for t in heldout_passages()]
        warm = prompts[:1]
    else:
        vocab = engine.model_info().vocab_size
        prompts = random_choices(args, vocab, seed=1)  # the same prompts for every arm
        warm = random_choices(args, vocab, seed=10_000)[: args.choices]
    k = 0 if args.heldout else 1
    arms = {} if args.heldout else {"prefill": SamplingParams(max_tokens=1)}
    arms["full_depth"] = SamplingParams(max_tokens=1, prompt_logprobs=k)
    for threshold in floats(args.thresholds):
        arms[f"exit_depth@{threshold}"] = SamplingParams(
            max_tokens=1,
            prompt_logprobs=k,
            score_at_exit_depth=True,
            exit_threshold=threshold,
            min_loops=args.min_loops,
        )
    results = record("prompt_scoring", args, model_path=str(engine.model_info().path), arms={})
    for name, params in arms.items():
        run_arm(engine, warm, params, args.device)
        wall, outputs = run_arm(engine, prompts, params, args.device)
        tokens = sum(len(prompt) for prompt in prompts)
        arm = results["arms"][name] = {"prompt_tokens": tokens, "wall_s": wall}
        first = next(iter(results["arms"].values()))
        arm["tokens_per_s"] = tokens / wall
        arm["ratio_to_first"] = arm["tokens_per_s"] / first["tokens_per_s"]
        line = f"{name:>18}: {arm['tokens_per_s']:,.0f} prompt tok/s ({arm['ratio_to_first']:.3f})"
        if args.heldout:
            arm |= quality(outputs, engine.model_info().num_loops)
            line += f", perplexity {arm['perplexity']:.3f}, {arm['mean_loops_per_token']:.3f} loops"
        print(line, flush=True)
        write_json(args.out, results)
    engine.shutdown()


if __name__ == "__main__":
    main()
