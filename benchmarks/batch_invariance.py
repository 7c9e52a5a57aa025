"""Cost and effect of `EngineConfig.batch_invariant`: the same workloads with it on and off.

For every (dtype, batch) cell, two engines on the same checkpoint (batch_invariant on / off)
replay the same seeded workload: `batch` requests of --prompt-len random prompt tokens, each
sampling --output-len tokens (temperature 0.9, top_p 0.8, its own seed, ignore_eos, logprobs),
all submitted at once; one warm-up run each, then --repeats measured runs of the two engines
interleaved, the fastest kept (robust to other load on a shared machine). Reported:

  output_tokens_per_s   end to end (first add_request to the last finish; device synchronized)
  prefill_tokens_per_s  a separate prefill-heavy run: the same prompts with max_tokens 1
  cost                  off / on time ratio - 1 of each (positive: the mode is slower)
  invariant             request 0 of the batch equals request 0 run alone (tokens, exit depths
                        and logprobs, bitwise); also measured with the mode off, where it shows
                        the defect the mode removes
  first_difference      with the mode off: the first token index whose logprob differs (None
                        if none), and the largest |logprob difference| up to the first token
                        that differs

Examples:
  uv run python benchmarks/batch_invariance.py                      # bundled model, CPU
  uv run python benchmarks/batch_invariance.py --dtype float32 --dtype bfloat16 \\
      --json-out benchmarks/results/batch_invariance_cpu.json
  # H200 (tools/h200_run.sh batch-invariance): Ouro-1.4B shape, random weights
  python3 benchmarks/batch_invariance.py --device cuda --shape ouro-1.4b --dtype bfloat16 \\
      --batch 1 --batch 8 --batch 32 --batch 128 --prompt-len 1024 --output-len 64 \\
      --max-num-seqs 128 --max-num-batched-tokens 4096 --prefill-chunk-size 1024

Numbers hold for the machine, revision and thread count they were measured with only.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

from harness import parser, record, sync, write_json
from workload import SHAPE_NAMES, ensure_checkpoint, random_prompts


def parse_args(argv=None):
    p = parser(__doc__, device="cpu", out=False)
    p.add_argument("--model", default=None, help="checkpoint dir (default: bundled model)")
    p.add_argument("--shape", default=None, choices=SHAPE_NAMES, help="or a random checkpoint")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--dtype", action="append", default=None, help="repeatable (bfloat16)")
    p.add_argument("--batch", action="append", type=int, default=None, help="repeatable (1,4,8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--exit-threshold", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: the cap for both engines together; each gets half (0.9)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk-size", type=int, default=128)
    p.add_argument("--json-out", type=Path, default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ["bfloat16"]
    args.batch = args.batch or [1, 4, 8]
    return args


def timed(llm, prompts, max_tokens: int, threshold: float):
    from rlt import SamplingParams

    fields = dict(max_tokens=max_tokens, temperature=0.9, top_p=0.8, exit_threshold=threshold)
    fields |= dict(ignore_eos=True, logprobs=0)
    sampling = [SamplingParams(seed=1000 + i, **fields) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    sync(llm.engine.parts.device.type)
    return time.perf_counter() - start, outputs


def build(args, model, dtype: str, invariant: bool, memory_share: float):
    from rlt import LLM

    return LLM(
        model,
        device=args.device,
        dtype=dtype,
        batch_invariant=invariant,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        gpu_memory_utilization=memory_share,
    )


def cells(args, model, dtype: str, batch: int) -> tuple[dict, dict]:
    """(on, off) for one (dtype, batch): both engines built first, their measured runs
    interleaved (on, off, on, off, ...) and the fastest of each kept, so that load from other
    processes on a shared machine biases neither side."""
    # Both engines live in this process, and an engine's share is counted against every tensor
    # of the process (the first engine's too): the first may fill half of the cap, the second
    # the rest of it.
    cap = args.gpu_memory_utilization
    engines = {True: build(args, model, dtype, True, cap / 2)}
    engines[False] = build(args, model, dtype, False, cap)
    try:
        vocab = engines[True].engine.parts.model.shape.vocab_size
        prompts = random_prompts(1234, batch, args.prompt_len, vocab)
        out_len, thr = args.output_len, args.exit_threshold
        decode = {True: [], False: []}
        prefill = {True: [], False: []}
        last = {}
        for llm in engines.values():
            timed(llm, prompts, out_len, thr)  # warm-up (and CUDA graph capture of new modes)
        for _ in range(args.repeats):
            for flag, llm in engines.items():
                seconds, last[flag] = timed(llm, prompts, out_len, thr)
                decode[flag].append(seconds)
                prefill[flag].append(timed(llm, prompts, 1, thr)[0])
        solo = {flag: timed(llm, prompts[:1], out_len, thr)[1][0] for flag, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
        gc.collect()
    return tuple(
        summary(args, dtype, batch, flag, decode[flag], prefill[flag], solo[flag], last[flag][0])
        for flag in (True, False)
    )


def summary(args, dtype, batch, invariant, decode, prefill, solo, batched) -> dict:
    wall, prefill_wall = min(decode), min(prefill)
    out_len = args.output_len
    pairs = list(zip(solo.logprobs, batched.logprobs, strict=True))
    differs = [i for i, (a, b) in enumerate(pairs) if a != b]
    tokens = zip(solo.token_ids, batched.token_ids, strict=True)
    token_diff = next((i for i, (a, b) in enumerate(tokens) if a != b), None)
    upto = len(solo.logprobs) if token_diff is None else token_diff + 1
    return {
        "dtype": dtype,
        "batch": batch,
        "batch_invariant": invariant,
        "output_tokens_per_s": batch * out_len / wall,
        "prefill_tokens_per_s": batch * args.prompt_len / prefill_wall,
        "wall_s": wall,
        "prefill_wall_s": prefill_wall,
        "invariant": (solo.token_ids, solo.exit_depths, solo.logprobs)
        == (batched.token_ids, batched.exit_depths, batched.logprobs),
        "first_logprob_difference": differs[0] if differs else None,
        "first_token_difference": token_diff,
        "max_abs_logprob_difference": max((abs(a - b) for a, b in pairs[:upto]), default=0.0),
        "mean_loops": batched.mean_loops,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    model = args.model
    if args.shape and not model:
        model = str(ensure_checkpoint(args.shape, args.checkpoint_dir, args.device))
    results = []
    for dtype in args.dtype:
        for batch in args.batch:
            on, off = cells(args, model, dtype, batch)
            results += [on, off]
            line = f"{dtype:9s} batch {batch:4d}:"
            for kind in ("output", "prefill"):
                a, b = off[f"{kind}_tokens_per_s"], on[f"{kind}_tokens_per_s"]
                line += f" {kind} {a:8.1f} -> {b:8.1f} tok/s (cost {a / b - 1:+.1%}),"
            line += f" solo == batched: on {on['invariant']}, off {off['invariant']}"
            if not off["invariant"]:
                line += (
                    f" (off: logprob {off['first_logprob_difference']}, token "
                    f"{off['first_token_difference']}, max "
                    f"{off['max_abs_logprob_difference']:.3g} nats)"
                )
            print(line, flush=True)
    threads, model = torch.get_num_threads(), model or "bundled default model"
    write_json(
        args.json_out,
        record("batch_invariance", args, threads=threads, model=model, results=results),
    )
    return 0 if all(r["invariant"] for r in results if r["batch_invariant"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
