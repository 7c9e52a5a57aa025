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

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from offline_throughput import ensure_checkpoint  # noqa: E402  (the benchmarks' checkpoints)


def workload(args, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(args.questions):
        context = [rng.randrange(vocab) for _ in range(args.context_len)]
        for _ in range(args.choices):
            prompts.append(context + [rng.randrange(vocab) for _ in range(args.choice_len)])
    return prompts


def run_arm(engine, prompts, params) -> float:
    import torch

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--model", default=None)
    parser.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=1000)
    parser.add_argument("--choice-len", type=int, default=24)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ensure_checkpoint(args),
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
    results: dict = {"setup": vars(args), "arms": {}}
    for name, params in arms.items():
        run_arm(engine, workload(args, vocab, seed=10_000)[: args.choices], params)  # warm-up
        prompts = workload(args, vocab, seed=1)  # the same prompts for every arm
        wall = run_arm(engine, prompts, params)
        tokens = sum(len(p) for p in prompts)
        results["arms"][name] = {
            "prompt_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
        }
        Path(args.out).write_text(json.dumps(results, indent=1))
    base = results["arms"]["prefill"]["tokens_per_s"]
    for name, arm in results["arms"].items():
        arm["ratio_to_prefill"] = arm["tokens_per_s"] / base
        print(
            f"{name:>11}: {arm['tokens_per_s']:,.0f} prompt tok/s ({arm['ratio_to_prefill']:.3f})"
        )
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
