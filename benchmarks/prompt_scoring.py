"""Prompt-scoring throughput against plain prefill, side by side in one process (issue 25).

One engine, one seeded workload: Q questions, each a shared context of --context-len random
tokens followed by C choices of --choice-len tokens (multiple choice as evaluation harnesses
send it: one request per choice, all of a question's choices at once). Arms, each over the
same prompts, after one warm-up question:
  prefill      max_tokens 1: what serving computes for these prompts (prefix caching shares
               the context across choices)
  full_depth   prompt_logprobs 1: every prompt token scored at full depth (a question's
               choices arrive together: the first computes the context, the others wait for
               its pages and their scores, rlt-scheduler's prefix waits, and reuse them)
  exit_depth   prompt_logprobs 1 + score_at_exit_depth at --threshold: scored at each
               position's exit depth (eager, position-major loops)
Reported per arm: prompt tokens / second (wall clock, all requests of the arm), and the
ratio to `prefill`.

    python3 benchmarks/prompt_scoring.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
        --out results.json
"""

from __future__ import annotations

import random
import time

from harness import parser, record, sync, write_json
from workload import SHAPE_NAMES, ensure_checkpoint


def workload(args, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(args.questions):
        context = [rng.randrange(vocab) for _ in range(args.context_len)]
        for _ in range(args.choices):
            prompts.append(context + [rng.randrange(vocab) for _ in range(args.choice_len)])
    return prompts


def run_arm(engine, prompts, params, device: str) -> float:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    sync(device)
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = parser(__doc__, device="cpu", dtype="float32")
    p.add_argument("--shape", default="tiny", choices=SHAPE_NAMES)
    p.add_argument("--model", default=None)
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-len", type=int, default=1000)
    p.add_argument("--choice-len", type=int, default=24)
    p.add_argument("--threshold", type=float, default=0.5)
    args = p.parse_args(argv)

    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ensure_checkpoint(args.shape, args.checkpoint_dir, args.device, args.model),
            device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=True,
        )
    )
    vocab = engine.model_info().vocab_size
    arms = {
        "prefill": SamplingParams(max_tokens=1),
        "full_depth": SamplingParams(max_tokens=1, prompt_logprobs=1),
        "exit_depth": SamplingParams(
            max_tokens=1,
            prompt_logprobs=1,
            score_at_exit_depth=True,
            exit_threshold=args.threshold,
        ),
    }
    results = record("prompt_scoring", args, arms={})
    for name, params in arms.items():
        warm = workload(args, vocab, seed=10_000)[: args.choices]
        run_arm(engine, warm, params, args.device)  # warm-up
        prompts = workload(args, vocab, seed=1)  # the same prompts for every arm
        wall = run_arm(engine, prompts, params, args.device)
        tokens = sum(len(p) for p in prompts)
        results["arms"][name] = {
            "prompt_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
        }
        write_json(args.out, results)
    base = results["arms"]["prefill"]["tokens_per_s"]
    for name, arm in results["arms"].items():
        arm["ratio_to_prefill"] = arm["tokens_per_s"] / base
        print(
            f"{name:>11}: {arm['tokens_per_s']:,.0f} prompt tok/s ({arm['ratio_to_prefill']:.3f})"
        )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
