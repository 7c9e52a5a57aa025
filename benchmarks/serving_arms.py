"""Serving arms side by side: each arm one server started from the same checkpoint and engine
options, then the same `rlt bench serve` runs against each (random prompts of --input-len
tokens, --output-len tokens out, ignore_eos), and the figures of every arm over the first's.

Arms (--arms, in order, NAME or NAME:KIND; the same kind may appear under several names):
  serve        rlt serve                          serve_api2   rlt serve --api-server-count 2
  ray          rlt ray serve --replicas 1 (the replica's engine core on one of its threads)
  ray_process  the same with --engine-process (the engine core in a process of its own)
  pd           rlt pd serve --num-prefill 1 --num-decode 1 (KV over NIXL from P to D)
  replicas     rlt pd serve --replicas 2 (the router's plain baseline)
Every arm gets --engine-json's EngineConfig fields as flags (--max-num-seqs 64 ...), then its
own from --arm-options ({"NAME": {field: value}}), --dtype / --device when given, and
--exit-threshold (1.0 by default: every token at full depth; "none" leaves the server's).

Per arm: start it (--cold-start: the first arm is started and stopped once before, so its
start-up is measured cold and then warm), wait for /health, send --warmup requests (not
measured), then --repeats times every --points entry: `C:N` is N requests with at most C in
flight, `rR:N` N requests arriving at R per second (Poisson); then --burst requests at once;
then stop it. Per run: every scalar of the bench's result (throughputs, TTFT / TPOT / ITL /
E2E p50 and p99, counts), the CPU seconds of the server's process tree, and when the first
wave was sent and the first and last responses came (client_timeline). --offline: before each
arm's server, one `LLMEngine` with the arm's options (once per set of options) runs each
concurrency point offline (the same prompt lengths, at most C in flight, a new request
entering as one finishes), and the served figures get their ratio to it. --step-logs DIR:
both sides record every engine step (RLT_STEP_LOG) and each measured run gets its step
timeline (step_timeline.py).

    python3 benchmarks/serving_arms.py CKPT --arms serve,ray --points 32:128,128:384 \\
        --repeats 2 --out r.json                              # tools/h200_run.sh ray-serve
    uv run python benchmarks/serving_arms.py --arms pd,replicas --dtype float32 \\
        --engine-json '{"max_num_seqs": 8}' --exit-threshold none --input-len 64 \\
        --output-len 16 --points r0.5:16,r1:16,r2:16 --warmup 4 --out /tmp/pd.json  # a CPU
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from harness import parser, record, sync, write_json
from server_process import Server
from step_timeline import load as load_step_log
from step_timeline import summarize

RLT, RAY = [sys.executable, "-m", "rlt.cli"], [sys.executable, "-m", "rlt_ray"]
KINDS = {  # kind: (command up to MODEL, flags after it)
    "serve": ([*RLT, "serve"], []),
    "serve_api2": ([*RLT, "serve"], ["--api-server-count", "2"]),
    "ray": ([*RAY, "serve"], ["--replicas", "1", "--no-engine-process"]),
    "ray_process": ([*RAY, "serve"], ["--replicas", "1", "--engine-process"]),
    "pd": ([*RLT, "pd", "serve"], ["--num-prefill", "1", "--num-decode", "1"]),
    "replicas": ([*RLT, "pd", "serve"], ["--replicas", "2"]),
}
COMPARED = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")
COMPARED += ("p99_tpot_ms", "median_itl_ms", "server_cpu_s")


def parse_points(text: str) -> list[tuple[str, int | None, float | None, int]]:
    """'32:128,r4:100' -> [("c32", 32, None, 128), ("r4", None, 4.0, 100)]."""
    points = []
    for item in filter(None, text.split(",")):
        where, count = item.split(":")
        if where.startswith("r"):
            points.append((where, None, float(where[1:]), int(count)))
        else:
            points.append((f"c{where}", int(where), None, int(count)))
    return points


def arm_command(args, kind: str, options: dict) -> list[str]:
    base, kind_flags = KINDS[kind]
    command = [*base, *([args.model] if args.model else []), *kind_flags]
    command += ["--served-model-name", "bench", "--log-level", args.log_level]
    if kind in ("pd", "replicas"):
        command += ["--instance-log-level", args.log_level]
    if args.exit_threshold != "none":
        command += ["--exit-threshold", args.exit_threshold]
    flags = {"dtype": args.dtype, "device": args.device}
    flags |= json.loads(args.engine_json) | options
    for key, value in flags.items():
        if value is not None:
            command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def offline(args, options: dict, points, tag: str) -> dict:
    """Output tokens/s of one LLMEngine with `options` at each concurrency point."""
    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    fields = {k: v for k, v in (("dtype", args.dtype), ("device", args.device)) if v}
    fields |= json.loads(args.engine_json) | options
    engine = LLMEngine(EngineConfig.from_options(model=args.model, **fields))
    vocab = engine.model_info().vocab_size
    threshold = (
        {} if args.exit_threshold == "none" else {"exit_threshold": float(args.exit_threshold)}
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **threshold)
    figures = {}
    for key, concurrency, _, count in (p for p in points if p[1] is not None):
        rng = random.Random(concurrency)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(count + 2)]
        drive(engine, prompts[count:], params, concurrency)  # warm-up
        before = dataclasses.replace(engine.core.timings)
        engine.core.step_log = [] if args.step_logs else None
        start = time.perf_counter()
        tokens = drive(engine, prompts[:count], params, concurrency)
        sync("cuda" if engine.parts.device.type == "cuda" else "cpu")
        end = time.perf_counter()
        after, records = engine.core.timings, engine.core.step_log
        engine.core.step_log = None
        figures[key] = dict(requests=count, output_tokens=tokens, wall_s=end - start)
        figures[key]["output_tokens_per_s"] = tokens / (end - start)
        for name in ("steps", "decode_ticks", "host_s", "readback_wait_s"):
            figures[key][name] = getattr(after, name) - getattr(before, name)
        if records is not None:
            figures[key]["timeline"] = summarize(records, start, end)
            with open(Path(args.step_logs) / f"offline_{tag}_{key}.jsonl", "w") as out:
                out.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
    engine.shutdown()
    return figures


def drive(engine, prompts, params, concurrency: int) -> int:
    """Every prompt through the engine, at most `concurrency` in flight; output tokens."""
    pending, running, tokens = list(enumerate(prompts)), 0, 0
    while pending or running:
        while pending and running < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(f"r{index}-{time.monotonic_ns()}", prompt, params)
            running += 1
        for output in engine.step():
            if output.finished:
                running -= 1
                tokens += len(output.token_ids)
    return tokens


def measure(server: Server, args, concurrency, rate, count: int, seed: int) -> dict:
    result, cpu = server.bench(
        input_len=args.input_len,
        output_len=args.output_len,
        count=count,
        seed=seed,
        concurrency=concurrency,
        rate=rate,
    )
    figures = {k: v for k, v in result.items() if isinstance(v, int | float | None)}
    figures["server_cpu_s"] = round(sum(cpu.values()), 2)
    figures["cpu_s_by_pid"] = {str(pid): seconds for pid, seconds in cpu.items()}
    started = result["started_perf_counter_s"]  # the bench's own start (one clock per host)
    figures["window_s"] = [started, started + result["duration"]]
    starts = [t for t in result["start_times"] if t is not None]
    pairs = list(zip(result["start_times"], result["e2els"], result["ttfts"], strict=True))
    ends = [s + e for s, e, _ in pairs if e is not None]
    firsts = [s + t for s, _, t in pairs if t is not None]
    wave = min(concurrency or len(starts), len(starts))
    figures["client_timeline"] = {
        "first_wave_sent_s": round(sorted(starts)[wave - 1], 4) if starts else None,
        "first_token_s": round(min(firsts), 4) if firsts else None,
        "last_end_s": round(max(ends), 4) if ends else None,
    }
    return figures


def run_arm(args, name: str, kind: str, points, results: dict) -> None:
    options = json.loads(args.arm_options).get(name, {})
    arm = results["arms"][name] = {"kind": kind, "options": options, "points": {}}
    if args.offline:  # once per set of options
        same = [a for a in results["arms"].values() if a.get("options") == options]
        known = next((a["offline"] for a in same if "offline" in a), None)
        arm["offline"] = known or offline(args, options, points, name)
        write_json(args.out, results)
    env = None
    if args.step_logs:
        from harness import child_env

        step_log = Path(args.step_logs) / f"served_{name}.jsonl"
        env = child_env(RLT_STEP_LOG=str(step_log))
    command = arm_command(args, kind, options)
    log = Path(args.log_dir) / f"server-{name}.log"
    if args.cold_start and not results["arms"].keys() - {name}:
        cold = Server(command, log, env=env, timeout_s=args.startup_timeout)
        arm["cold_startup_s"] = cold.startup_s
        cold.stop(args.stop_timeout)
    print(f"arm {name} ({kind}): {shlex.join(command[2:])}", flush=True)
    server = Server(command, log, env=env, timeout_s=args.startup_timeout)
    arm |= {"command": shlex.join(server.command[2:]), "startup_s": round(server.startup_s, 1)}
    print(f"  healthy after {server.startup_s:.1f} s", flush=True)
    try:
        if args.warmup:
            measure(server, args, None, None, args.warmup, seed=7)
        burst = [("burst", None, None, args.burst)] if args.burst else []
        for repeat in range(args.repeats):
            for key, concurrency, rate, count in points + burst:
                figures = measure(server, args, concurrency, rate, count, 1000 * repeat + count)
                arm["points"].setdefault(key, []).append(figures)
                print(
                    f"  {key} n={count} #{repeat + 1}: {figures['output_throughput']:.1f} tok/s, "
                    f"TTFT p50 {figures['median_ttft_ms']:.1f} ms, TPOT p50 "
                    f"{figures['median_tpot_ms']:.2f} ms, {figures.get('failed', 0)} failed",
                    flush=True,
                )
                write_json(args.out, results)
    except Exception as exc:
        arm["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        print(f"  {name} failed: {arm['error']}\n{server.tail()}", flush=True)
    finally:
        arm["exit_code"] = server.stop(args.stop_timeout)
        arm["log_lines"] = server.log_lines("start-up", "core totals")
    if args.step_logs and step_log.exists():
        records = load_step_log(step_log)
        for runs in arm["points"].values():
            for figures in runs:
                figures["timeline"] = summarize(records, *figures["window_s"])
    for key, runs in arm["points"].items():
        offline_figures = arm.get("offline", {}).get(key)
        for figures in runs:
            if offline_figures:
                ratio = figures["output_throughput"] / offline_figures["output_tokens_per_s"]
                figures["ratio_to_offline"] = round(ratio, 4)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def compare(arms: dict) -> dict:
    """Per point: each arm's mean over its repeats and its ratio to the first arm's."""
    names = [n for n, arm in arms.items() if arm.get("points")]
    table = {}
    for key in dict.fromkeys(k for n in names for k in arms[n]["points"]):
        row = table[key] = {}
        for figure in COMPARED:
            means = {n: mean(r.get(figure) for r in arms[n]["points"].get(key, [])) for n in names}
            base = means[names[0]]
            ratios = {n: round(v / base, 4) if v and base else None for n, v in means.items()}
            row[figure] = {"mean": means, "ratio_to_first": ratios}
    return table


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the bundled)")
    p.add_argument("--arms", default="serve", help="NAME or NAME:KIND, comma-separated")
    p.add_argument("--arm-options", default="{}", help='{"NAME": {EngineConfig field: value}}')
    p.add_argument("--engine-json", default="{}", help="EngineConfig fields of every arm")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None, help="pd kinds: one per instance, comma-separated")
    p.add_argument("--exit-threshold", default="1.0", help='"none": the server\'s default')
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--points", default="32:128,128:384", help="C:N (concurrency) or rR:N (rate)")
    p.add_argument("--burst", type=int, default=0, help="then this many requests at once")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=16, help="requests before measuring")
    p.add_argument("--offline", action="store_true", help="the offline engine per arm first")
    p.add_argument("--cold-start", action="store_true", help="start the first arm twice")
    p.add_argument("--step-logs", default=None, help="a folder: every engine step recorded")
    p.add_argument("--log-dir", default=None, help="server logs (default: --out's folder)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--stop-timeout", type=float, default=60.0, help="after SIGINT")
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out is required")
    args.log_dir = args.log_dir or str(Path(args.out).resolve().parent)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    points = parse_points(args.points)
    arms = [(item.split(":") + [item])[:2] for item in args.arms.split(",")]
    results = record("serving_arms", args, arms={})
    for name, kind in arms:
        name = name if name not in results["arms"] else f"{name}_again"
        try:
            run_arm(args, name, kind, points, results)
        except RuntimeError as exc:  # did not start
            results["arms"].setdefault(name, {})["error"] = str(exc)[-4000:]
            print(f"  {name} did not start: {exc}", flush=True)
        results["comparison"] = compare(results["arms"])
        write_json(args.out, results)
    for key, row in results["comparison"].items():
        print(f"{key}: output tok/s {row['output_throughput']['ratio_to_first']}")
    return 0 if all("error" not in arm for arm in results["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
