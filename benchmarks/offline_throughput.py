"""Offline throughput of the rlt engine, several arms measured side by side in one process.

Every arm builds its own engine on the same checkpoint and replays the same seeded workload
(random prompt token ids, fixed output length, ignore_eos, greedy). Arms (repeat --arm):
  fixed            threshold 1.0: every token runs the full depth (families without an exit
                   signal, e.g. Nanbeige4.2: no threshold, which means the same)
  gate             exit_threshold 0.999999, min_loops 2: the exit gate is computed and tested
                   after every loop, yet practically no token exits (random weights); shows the
                   cost of the adaptive path against `fixed`
  threshold:Q      adaptive exit with the model's gate at threshold Q in [0, 1] (min_loops 2)
  trace:P2,P3,P4   depths 2, 3, 4.. replayed (the `trace` policy) from a seeded trace with these
                   probabilities, e.g. trace:0.55,0.40,0.05 ("mix 2.5"); trace:uniform:A-B:
                   uniform on A..B; token 0 and the warm-ups at the model's default depth
  POLICY:T         live exits of the policy latent_diff(_delayed) or kl(_delayed) at threshold T
Suffixes (combinable): @no_refill (cohort scheduling), @eager (no CUDA graphs),
@eager_prefill (decode graphs only: prefill_cuda_graphs=False), @sync (async_scheduling=False),
@ticks=N (decode_ticks_per_step=N), @noprofile (skip the --profile-steps window for this arm),
@fp8 (quantization="fp8": fp8 weights of the stack), @kv_fp8 (kv_cache_dtype="fp8");
e.g. fixed@sync, trace:0.55,0.40,0.05@ticks=4, fixed@fp8@kv_fp8. --kv-layout (e.g. ring:8),
--max-model-loops (the loop cap) and --warmup-prompt-len (see run_arm) hold for every arm.

Per arm (the record's "results"; all times host wall clock, time.perf_counter):
  output_tokens_per_s         end to end: output tokens of all requests / wall_s, wall_s from
                              just before the first add_request to the step that finished the
                              last request (plus a device synchronize)
  decode_output_tokens_per_s  decode phase (workload.decode_phase over the measured run's
                              step log): tokens of the steps without prefill work over their
                              duration, device-clock spacing on CUDA; null if no such step
  decode_output_tokens, decode_wall_s, decode_steps: its numerator, denominator and steps;
  steps, step_ms (wall_s / steps), decode_ticks, host_ms_per_step and readback_wait_ms_per_step
  (StepTimings deltas per step), mean_loops_per_decoded_token (tokens 1..; token 0 is the
  prefill's), kv_blocks, max_running (most running requests after any step), preemptions,
  gemv_choices (the small-batch and fp8 GEMVs chosen per rows x N x K), allocator (CUDA
  allocation retries and new segments during the run: both should be 0), prefill graph
  captures during the run and their seconds, and with --profile-steps N the decode profile
  (decode_profile.py), kv_capacity (rlt.engine.kv_capacity) and kv_cache_dtype. --keep-step-log
  keeps every step as [prefill tokens, ticks, tokens, host ms since the start, device ms].

--shape picks a random checkpoint (workload.py). Examples:
  uv run python benchmarks/offline_throughput.py --shape tiny --arm fixed --arm gate
  python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda --dtype bfloat16 \\
      --prompt-len 1024 --output-len 128 --prefill-chunk-size 1024 --num-requests 64 \\
      --max-num-seqs 32 --max-num-batched-tokens 2048 --arm fixed --arm trace:0.55,0.40,0.05
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

from harness import free_memory, markdown_table, parser, record, sync, write_json
from workload import SHAPE_NAMES, decode_phase, ensure_checkpoint, random_prompts

WARMUP_TOKENS = 4
GATE_THRESHOLD = 0.999999
SUFFIXES = ("no_refill", "eager", "eager_prefill", "sync", "noprofile", "fp8", "kv_fp8")
LIVE_POLICIES = ("latent_diff", "latent_diff_delayed", "kl", "kl_delayed")


def warmup_requests(args) -> int:
    """Warm-up requests per arm (each WARMUP_TOKENS long): as many as the measured run has, so
    its prefill chunks meet decode batches of the sizes the timed run sees and the one-time work
    of each new shape (Triton compilations per specialization, cuBLAS heuristics) is done
    before timing. With fewer (4, then max_num_seqs + 1), the first arms of a c32 process paid
    such costs inside their timed runs: the third arm, same compute as the first, ran 15%
    faster end to end (decode, which excludes prefill steps, was equal). SHARED layouts (whose
    prefill advances position by position) keep max_num_seqs + 1 short prompts."""
    if args.kv_layout == "shared":
        return max(4, min(args.num_requests, args.max_num_seqs + 1))
    return max(4, args.num_requests)


def parse_arm(spec: str):
    """-> (sampling kwargs, engine kwargs, trace {depth: weight} or None, profile?)."""
    name, *flags = spec.split("@")
    engine = {
        "scheduling_mode": "no_refill" if "no_refill" in flags else "refill",
        "cuda_graphs": "eager" not in flags,
        "prefill_cuda_graphs": "eager_prefill" not in flags,
        "async_scheduling": "sync" not in flags,
    }
    if "fp8" in flags:
        engine["quantization"] = "fp8"
    if "kv_fp8" in flags:
        engine["kv_cache_dtype"] = "fp8"
    for flag in flags:
        if flag.startswith("ticks="):
            engine["decode_ticks_per_step"] = int(flag.removeprefix("ticks="))
        elif flag not in SUFFIXES:
            raise SystemExit(f"unknown arm suffix @{flag} in {spec!r}")
    profile = "noprofile" not in flags
    kind, _, value = name.partition(":")
    if name == "fixed":
        return {"exit_threshold": 1.0}, engine, None, profile
    if name == "gate":
        return {"exit_threshold": GATE_THRESHOLD, "min_loops": 2}, engine, None, profile
    if kind == "threshold":
        return {"exit_threshold": float(value), "min_loops": 2}, engine, None, profile
    if kind in LIVE_POLICIES:
        return {"exit_threshold": float(value)}, {**engine, "exit_policy": kind}, None, profile
    if kind == "trace":
        if value.startswith("uniform:"):
            low, high = (int(x) for x in value.removeprefix("uniform:").split("-"))
            weights = dict.fromkeys(range(low, high + 1), 1.0)
        else:
            weights = {depth: float(x) for depth, x in enumerate(value.split(","), 2)}
        return {"exit_threshold": 1.0}, {**engine, "exit_policy": "trace"}, weights, profile
    raise SystemExit(f"unknown arm {spec!r}")


def write_trace(path: Path, weights: dict[int, float], model_dir: Path, args) -> None:
    """Seeded per-request depth lists: token 0 at the model's default depth (the requests omit
    max_loops), then depths drawn with `weights` (bench-i: the measured requests, profile-i:
    the profile window's, warmup-i: all at the default depth)."""
    from rlt_models.families import read_config

    full = read_config(model_dir).declaration().default_loops
    rng = random.Random(args.seed + 1)
    depths, probs = list(weights), list(weights.values())
    names = [f"bench-{i}" for i in range(args.num_requests)]
    names += [f"profile-{i}" for i in range(args.max_num_seqs)]
    trace = {n: [full] + rng.choices(depths, probs, k=args.output_len - 1) for n in names}
    trace.update({f"warmup-{i}": [full] * WARMUP_TOKENS for i in range(warmup_requests(args))})
    path.write_text(json.dumps(trace))


def run_arm(spec: str, args, model_dir: Path, prompts) -> dict:
    from rlt import LLMEngine, SamplingParams
    from rlt.engine import EngineConfig

    sampling_kwargs, engine_kwargs, trace_probs, profile_arm = parse_arm(spec)
    if trace_probs is not None:
        trace_path = Path(args.checkpoint_dir) / f"trace-{os.getpid()}-{abs(hash(spec))}.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        write_trace(trace_path, trace_probs, model_dir, args)
        engine_kwargs["exit_trace"] = str(trace_path)
    engine = LLMEngine(
        EngineConfig.from_options(
            model=model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_layout=args.kv_layout,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=args.prefill_chunk_size,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.prompt_len + args.output_len,
            max_model_loops=args.max_model_loops,
            **engine_kwargs,
        )
    )
    try:
        if spec.split("@")[0] == "fixed" and engine.model_info().exit_signal == "none":
            # a family without an exit signal runs every token at its depth when no threshold
            # is set, and refuses an explicit one
            sampling_kwargs = {}
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **sampling_kwargs)
        warmup = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, **sampling_kwargs)
        # SHARED prefill runs position by position (one token per row and wave), so short
        # prompts warm it up as well as long ones, and much faster; --warmup-prompt-len cuts
        # all but the first warm-up prompt (decode graphs are captured at start anyway)
        full = 16 if args.kv_layout == "shared" else args.prompt_len
        cut = min(full, args.warmup_prompt_len or full)
        for i in range(warmup_requests(args)):  # warm-up: kernels, allocator, autotuning
            prompt = prompts[i % len(prompts)][: cut if i else full]
            engine.add_request(f"warmup-{i}", prompt, warmup)
        while engine.has_unfinished_requests():
            engine.step()
        sync(args.device)
        result = measure(engine, spec, args, prompts, params)
        if args.profile_steps > 0 and profile_arm:
            from decode_profile import profile_decode_window

            try:
                result["profile"] = profile_decode_window(engine, args, prompts, params)
            except Exception as exc:  # the measured numbers stand without it
                traceback.print_exc()
                result["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    finally:
        getattr(engine, "shutdown", lambda: None)()
        del engine  # the last reference: what the engine held can be freed now
        free_memory(args.device)
        if trace_probs is not None:
            Path(engine_kwargs["exit_trace"]).unlink(missing_ok=True)  # read at construction


def measure(engine, spec, args, prompts, params) -> dict:
    core = engine.core
    t = core.timings
    steps0, host0, wait0 = t.steps, t.host_s, t.readback_wait_s
    preempt0 = engine.get_stats().preemptions
    allocator0 = allocator_counts(args.device)
    graphs = core.runner.prefill_graphs
    captured0 = None if graphs is None else (graphs.captured, graphs.capture_s)
    core.step_log = []
    depths, tokens, max_running = [], 0, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                depths.extend(out.exit_depths[1:])
        max_running = max(max_running, engine.get_stats().running_requests)
    sync(args.device)
    wall = time.perf_counter() - start
    records, core.step_log = core.step_log, None
    steps = t.steps - steps0
    d_tokens, d_seconds, d_steps = decode_phase(records)
    allocator1 = allocator_counts(args.device)
    return {
        "arm": spec,
        "kv_layout": args.kv_layout,
        "requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "decode_output_tokens": d_tokens,
        "decode_wall_s": round(d_seconds, 4),
        "decode_output_tokens_per_s": round(d_tokens / d_seconds, 1) if d_seconds > 0 else None,
        "decode_steps": d_steps,
        "mean_loops_per_decoded_token": round(sum(depths) / max(len(depths), 1), 3),
        "steps": steps,
        "step_ms": round(1000 * wall / max(steps, 1), 3),
        "decode_ticks": sum(r.decode_ticks for r in records),
        "host_ms_per_step": round(1000 * (t.host_s - host0) / max(steps, 1), 3),
        "readback_wait_ms_per_step": round(1000 * (t.readback_wait_s - wait0) / max(steps, 1), 3),
        "kv_blocks": engine.parts.memory_plan.num_blocks,
        "kv_capacity": engine.parts.kv_capacity and dataclasses.asdict(engine.parts.kv_capacity),
        "kv_cache_dtype": engine.parts.kv_cache_dtype,
        "max_running": max_running,
        "preemptions": engine.get_stats().preemptions - preempt0,
        "async_scheduling": core.async_scheduling,
        "decode_ticks_per_step": engine.config.scheduler.decode_ticks_per_step,
        "cuda_graphs_active": getattr(core.runner, "graphs", None) is not None,
        "attention_backend": engine.parts.attention_backend,
        "gemv_choices": gemv_choices(),
        "allocator": allocator0 and {k: allocator1[k] - v for k, v in allocator0.items()},
        "prefill_graph_captures": captured0 and graphs.captured - captured0[0],
        "prefill_graph_capture_s": captured0 and round(graphs.capture_s - captured0[1], 3),
        "profile": None,
        "step_log": [step_row(r, start) for r in records] if args.keep_step_log else None,
    }


def step_row(r, start: float) -> list:
    """[prefill tokens, ticks, tokens, host ms since `start`, device ms (None off CUDA)]."""
    device_ms = None if r.device_s is None else round(1000 * r.device_s, 3)
    return [
        r.prefill_tokens,
        r.decode_ticks,
        r.generated,
        round(1000 * (r.done_s - start), 3),
        device_ms,
    ]


def allocator_counts(device: str) -> dict | None:
    """Cumulative caching-allocator counters of the current CUDA device (None off CUDA):
    allocations that failed, freed the cache and retried (each synchronizes), new segments."""
    if not device.startswith("cuda"):
        return None
    import torch

    stats = torch.cuda.memory_stats()
    return {
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "segment_allocs": stats.get("segment.all.allocated", 0),
    }


def gemv_choices() -> dict:
    """{"rows x N x K": "cublas" or the Triton tile} of the process's small-batch GEMV
    selections so far, {"fp8 rows x N x K": kind and tile} of its fp8 ones (empty off CUDA).
    Near-ties have gone either way between runs, so each arm records what it ran."""
    from rlt_models.fp8_linear import fp8_linear
    from rlt_models.small_batch_linear import small_batch_linear

    def tile(config) -> str:
        return f"{config.block_n}x{config.block_k}/w{config.num_warps}/s{config.num_stages}" + (
            "/row" if config.single_row else ""
        )

    choices = {
        f"{rows}x{n}x{k}": "cublas" if config is None else tile(config)
        for (rows, n, k, *_), config in small_batch_linear.choices.items()
    }
    for (rows, n, k, *_), choice in fp8_linear.choices.items():
        label = choice.kind if choice.tile is None else f"{choice.kind} {tile(choice.tile)}"
        choices[f"fp8 {rows}x{n}x{k}"] = label
    return choices


def print_table(results: list[dict]) -> None:
    keys = ("output_tokens_per_s", "decode_output_tokens_per_s", "mean_loops_per_decoded_token")
    keys += ("steps", "decode_steps", "step_ms", "host_ms_per_step", "readback_wait_ms_per_step")
    keys += ("kv_blocks", "max_running")
    header = ["arm", "e2e tok/s", "dec tok/s", "loops", "steps", "dec st", "step ms", "host ms"]
    header += ["wait ms", "kv blk", "run"]
    print(markdown_table(header, [[r["arm"]] + [r[k] for k in keys] for r in results]))
    for r in results:
        p = r["profile"]
        if p and p.get("gpu_busy_fraction") is not None:
            print(
                f"profile {r['arm']}: busy {p['gpu_busy_fraction']:.3f}, "
                f"{p['kernels_per_loop']} kernels/loop, {p['gpu_ms_per_loop']} GPU ms/loop "
                f"(GEMM {p['gemm_ms_per_loop']}), graph kernels seen {p['graph_kernels_seen']}"
            )
        elif p:
            print(f"profile {r['arm']}: {p.get('error', 'no kernel events')}")
    base = results[0]
    for r in results[1:]:
        e2e = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        line = f"{r['arm']} / {base['arm']}: e2e {e2e:.2f}x"
        if r["decode_output_tokens_per_s"] and base["decode_output_tokens_per_s"]:
            ratio = r["decode_output_tokens_per_s"] / base["decode_output_tokens_per_s"]
            line += f", decode {ratio:.2f}x"
        print(line)


def build_parser():
    p = parser(__doc__, device="cpu", dtype="float32", out=False)
    p.add_argument("--model", help="checkpoint directory (default: a random --shape checkpoint)")
    p.add_argument("--shape", default="tiny", choices=SHAPE_NAMES)
    p.add_argument("--checkpoint-dir", default=".runs/bench-checkpoints")
    p.add_argument("--kv-layout", default="last_exited")
    for name, default in (("num-requests", 32), ("prompt-len", 64), ("output-len", 32)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("max-num-seqs", 8), ("max-num-batched-tokens", 512)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--prefill-chunk-size", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-loops", type=int, default=None, help="the engine's loop cap")
    p.add_argument("--warmup-prompt-len", type=int, default=None, help="see run_arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arm", action="append", default=[], help="repeatable; see above")
    p.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many decode steps per arm"
    )
    p.add_argument("--profile-prompt-len", type=int, default=None, help="default: --prompt-len")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--write-checkpoint-only", action="store_true", help="write --shape's, exit")
    p.add_argument("--json-out", type=Path, help="write the JSON record here")
    p.add_argument("--keep-step-log", action="store_true", help="keep each arm's step log")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    arms = args.arm or ["fixed", "gate"]
    for arm in arms:
        parse_arm(arm)  # fail fast on a bad spec
    if args.cpu_threads and not args.device.startswith("cuda"):
        import torch

        torch.set_num_threads(args.cpu_threads)
    model_dir = ensure_checkpoint(args.shape, args.checkpoint_dir, args.device, args.model)
    if args.write_checkpoint_only:
        print(f"checkpoint ready: {model_dir}", flush=True)
        return 0
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.seed, args.num_requests, args.prompt_len, vocab)
    results, errors = [], []
    for arm in arms:
        t0 = time.perf_counter()
        try:
            results.append(run_arm(arm, args, model_dir, prompts))
            print(f"arm {arm} done in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:  # report it, free what it held, and go on with the next arm
            traceback.print_exc()
            errors.append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"})
            del exc
            free_memory(args.device)
            print(f"arm {arm} FAILED after {time.perf_counter() - t0:.1f} s", flush=True)
        # saved after every arm: a process cut short keeps the arms it measured
        write_json(
            args.json_out, record("offline_throughput", args, results=results, errors=errors)
        )
    if results:
        print_table(results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
