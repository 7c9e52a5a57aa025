"""Served against offline throughput in one run, and `rlt serve`'s start-up (issue 23).

One machine, one checkpoint, the engine's defaults on both sides (what `rlt serve` runs):
1. offline: one `LLMEngine`; for each concurrency C, N random-token prompts of --input-len
   tokens, --output-len tokens each (ignore_eos, greedy), at most C in flight (a new request
   enters as one finishes, as `rlt bench serve --max-concurrency C` does); output tokens / wall
   seconds. The engine is then shut down and its memory returned.
2. served: `rlt serve` started twice (the first start fills the caches, the second is timed as
   a warm start), then `rlt bench serve` at the same C and N (random dataset, same lengths) and
   a burst of --burst requests at once; the front end's and the core's CPU seconds during the
   burst (from /proc). 3. the same with `--api-server-count 2` (C = 128 and the burst).

Every figure goes to --out (JSON) as it is measured, so a run cut short still reports.

    python3 benchmarks/served_vs_offline.py /tmp/rlt-bench-checkpoints/ouro-1.4b --out r.json

--step-logs DIR: both sides record every engine step (offline `EngineCore.step_log`, served
`RLT_STEP_LOG`, the log files kept in DIR), and each measured phase gets a `timeline`
(benchmarks/step_timeline.py): the device's busy and idle seconds over the phase and the steps
split by whether they computed prompts, so served and offline runs compare step by step.

A/B of scheduler options (--arms, a JSON object {arm name: {EngineConfig field: value}}): per
arm, in the order given, the offline engine and then one `rlt serve` with the arm's options
on top of --engine-json, --warmup requests to the server first (not measured), then every
--points concurrency and the --burst; no cold start and no --api-server-count 2. The JSON
holds per arm its offline and served figures and the ratios (served / offline per C, burst /
served at the largest C), and `summary` one row per arm.

    python3 benchmarks/served_vs_offline.py CKPT --out ab.json --points 32:64,128:256 \
        --burst 384 --arms '{"base": {}, "auto": {"prefill_step_decode_ticks": "auto"}}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server_processes import free_port, run_bench_serve
from step_timeline import load as load_step_log
from step_timeline import summarize


def offline(args, results: dict, options: dict | None = None) -> None:
    """Offline figures into results["offline"][C]; `options`: EngineConfig fields of an arm
    on top of --engine-json."""
    import torch
    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    options = json.loads(args.engine_json) | (options or {})
    config = EngineConfig(model=args.model, dtype=args.dtype, **options)
    engine = LLMEngine(config)
    vocab = engine.model_info().vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, exit_threshold=1.0)
    for concurrency, count in args.points:
        rng = random.Random(concurrency)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(count)]
        warm = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(2)]
        _drive(engine, warm, params, concurrency)
        before = dataclasses.replace(engine.core.timings)
        if args.step_logs:
            engine.core.step_log = []
        start = time.perf_counter()
        tokens = _drive(engine, prompts, params, concurrency)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = time.perf_counter()
        wall = end - start
        after = engine.core.timings
        records, engine.core.step_log = engine.core.step_log, None
        results["offline"][str(concurrency)] = dict(
            requests=count,
            output_tokens=tokens,
            wall_s=wall,
            output_tokens_per_s=tokens / wall,
            steps=after.steps - before.steps,
            decode_ticks=after.decode_ticks - before.decode_ticks,
            host_s=after.host_s - before.host_s,
            readback_wait_s=after.readback_wait_s - before.readback_wait_s,
        )
        if records is not None:
            results["offline"][str(concurrency)]["timeline"] = summarize(records, start, end)
            name = f"offline_{args.tag}_c{concurrency}.jsonl"
            with open(Path(args.step_logs) / name, "w") as out:
                out.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
        _save(args, results)
    engine.shutdown()


def _drive(engine, prompts, params, concurrency: int) -> int:
    pending = list(enumerate(prompts))
    running, tokens = 0, 0
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


class Served:
    def __init__(self, args, *flags: str, options: dict | None = None) -> None:
        """`rlt serve` with --engine-json's options, then `options` (an arm's) on top; with
        --step-logs its core records every step into a file there."""
        import os

        self.port = free_port()
        env = dict(os.environ)
        self.step_log = None
        if args.step_logs:
            self.step_log = Path(args.step_logs) / f"served_{args.tag}_{self.port}.jsonl"
            env["RLT_STEP_LOG"] = str(self.step_log)
        command = [sys.executable, "-m", "rlt.cli", "serve", args.model, "--port", str(self.port)]
        command += ["--dtype", args.dtype, "--exit-threshold", "1.0", *flags]
        command += ["--log-level", "info", "--served-model-name", "bench"]
        for key, value in (json.loads(args.engine_json) | (options or {})).items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        start = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        import urllib.request

        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"rlt serve exited:\n{Path(self.log.name).read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        self.startup_s = time.perf_counter() - start

    def bench(self, args, concurrency: int | None, count: int) -> dict:
        start = time.perf_counter()
        result, cpu = run_bench_serve(
            self.port,
            self.process.pid,
            input_len=args.input_len,
            output_len=args.output_len,
            count=count,
            seed=count,
            concurrency=concurrency,
        )
        keys = ["output_throughput", "completed", "duration"]
        keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
        summary = {k: result.get(k) for k in keys}
        summary["cpu_s"] = {str(p): seconds for p, seconds in cpu.items()}
        started = result["started_perf_counter_s"]  # the bench's own start (same clock)
        summary["window_s"] = [started, started + result["duration"]]
        summary["client"] = client_timeline(result, concurrency)
        summary["bench_process_s"] = time.perf_counter() - start  # its start-up included
        return summary

    def stop(self) -> str:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return Path(self.log.name).read_text()

    def timelines(self, section: dict) -> None:
        """Each measured phase of `section` (entries with a window) gets its step timeline."""
        if self.step_log is None or not self.step_log.exists():
            return
        records = load_step_log(self.step_log)
        for figures in section.values():
            if isinstance(figures, dict) and "window_s" in figures:
                figures["timeline"] = summarize(records, *figures["window_s"])


def client_timeline(result: dict, concurrency: int | None) -> dict:
    """When the bench sent its first wave of requests and when the first and last responses
    ended, in seconds after its start."""
    starts = sorted(t for t in result["start_times"] if t is not None)
    wave = min(concurrency or len(starts), len(starts))
    ends = [
        s + e for s, e in zip(result["start_times"], result["e2els"], strict=True) if e is not None
    ]
    firsts = [
        s + t for s, t in zip(result["start_times"], result["ttfts"], strict=True) if t is not None
    ]
    return {
        "first_wave_sent_s": round(starts[wave - 1], 4) if starts else None,
        "first_token_s": round(min(firsts), 4) if firsts else None,
        "last_end_s": round(max(ends), 4) if ends else None,
    }


def served(args, results: dict) -> None:
    first = Served(args)
    results["startup_s"] = {"first": first.startup_s}
    first.stop()
    server = Served(args)
    results["startup_s"]["warm"] = server.startup_s
    try:
        for concurrency, count in args.points:
            results["served"][str(concurrency)] = server.bench(args, concurrency, count)
            _save(args, results)
        results["served"]["burst"] = server.bench(args, None, args.burst)
        results["served"]["pids"] = {"front_end": server.process.pid}
        _save(args, results)
    finally:
        log = server.stop()
    server.timelines(results["served"])
    results["startup_log"] = [line for line in log.splitlines() if "start-up" in line]
    results["served_core_totals"] = [line for line in log.splitlines() if "core totals" in line]
    _save(args, results)
    if args.no_two:
        return
    two = Served(args, "--api-server-count", "2")
    try:
        results["served_2_api"] = {
            "128": two.bench(args, 128, dict(args.points).get(128, 256)),
            "burst": two.bench(args, None, args.burst),
        }
    finally:
        two.stop()
    two.timelines(results["served_2_api"])
    _save(args, results)


def run_arms(args, results: dict) -> None:
    """--arms: per arm the offline engine, then its own `rlt serve` (module docstring)."""
    arms = json.loads(args.arms)
    del results["offline"], results["served"]  # per arm instead
    results["arms"] = {}
    for name, options in arms.items():
        arm = results["arms"][name] = {"options": options, "offline": {}, "served": {}}
        print(f"arm {name}: {options}", flush=True)
        args.tag = name
        if not args.skip_offline:
            offline(args, arm, options)
        server = Served(args, options=options)
        arm["startup_s"] = server.startup_s
        try:
            if args.warmup:
                server.bench(args, None, args.warmup)
            for concurrency, count in args.points:
                arm["served"][str(concurrency)] = server.bench(args, concurrency, count)
                _save(args, results)
            if args.burst:
                arm["served"]["burst"] = server.bench(args, None, args.burst)
        finally:
            log = server.stop()
        server.timelines(arm["served"])
        arm["served_core_totals"] = [line for line in log.splitlines() if "core totals" in line]
        arm["ratios"] = ratios(args, arm)
        _save(args, results)
    results["summary"] = [
        {"arm": name, **arm["ratios"], **served_throughputs(arm)}
        for name, arm in results["arms"].items()
    ]
    _save(args, results)
    for row in results["summary"]:
        print(json.dumps(row))


def ratios(args, section: dict) -> dict:
    """served / offline output throughput per C; the burst against served at the largest C.
    Adds them to the served entries too (as the single-configuration run always did)."""
    found = {}
    for c, _ in args.points:
        o, s = section["offline"].get(str(c)), section["served"].get(str(c))
        if o and s:
            s["ratio_to_offline"] = s["output_throughput"] / o["output_tokens_per_s"]
            found[f"served_to_offline_c{c}"] = round(s["ratio_to_offline"], 4)
    top = max(c for c, _ in args.points)
    burst, served_top = section["served"].get("burst"), section["served"].get(str(top))
    if burst and served_top:
        burst[f"ratio_to_served_{top}"] = (
            burst["output_throughput"] / (served_top["output_throughput"])
        )
        found[f"burst_to_served_c{top}"] = round(burst[f"ratio_to_served_{top}"], 4)
    return found


def served_throughputs(section: dict) -> dict:
    """Output tok/s, TTFT and ITL p50 per served point of one arm (for the summary)."""
    row = {}
    for point, figures in section["served"].items():
        row[f"served_tok_s_{point}"] = round(figures["output_throughput"], 1)
        row[f"ttft_p50_ms_{point}"] = round(figures["median_ttft_ms"], 1)
        row[f"itl_p50_ms_{point}"] = round(figures["median_itl_ms"], 2)
    for point, figures in section["offline"].items():
        row[f"offline_tok_s_{point}"] = round(figures["output_tokens_per_s"], 1)
    return row


def _save(args, results: dict) -> None:
    Path(args.out).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--points", default="1:8,32:96,128:384", help="C:N pairs")
    parser.add_argument("--burst", type=int, default=512)
    parser.add_argument("--engine-json", default="{}", help="EngineConfig fields for both sides")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument(
        "--step-logs", default=None, help="a directory: record every step on both sides there"
    )
    parser.add_argument("--no-two", action="store_true", help="skip --api-server-count 2")
    parser.add_argument(
        "--arms",
        default=None,
        help='A/B: JSON {"name": {EngineConfig field: value}, ...}; each arm runs offline and '
        "its own `rlt serve` (module docstring)",
    )
    parser.add_argument(
        "--warmup", type=int, default=16, help="--arms: requests sent to each server first"
    )
    args = parser.parse_args()
    args.points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    args.tag = "main"
    if args.step_logs:
        Path(args.step_logs).mkdir(parents=True, exist_ok=True)
    results: dict = {"setup": vars(args) | {"points": args.points}, "offline": {}, "served": {}}
    if args.arms is not None:
        run_arms(args, results)
        return
    if not args.skip_offline:
        offline(args, results)
    served(args, results)
    for c, _ in args.points:
        o, s = results["offline"].get(str(c)), results["served"].get(str(c))
        if o and s:
            s["ratio_to_offline"] = s["output_throughput"] / o["output_tokens_per_s"]
            print(f"C={c}: served/offline = {s['ratio_to_offline']:.3f}")
    burst, top = results["served"].get("burst"), results["served"].get("128")
    if burst and top:
        burst["ratio_to_served_128"] = burst["output_throughput"] / top["output_throughput"]
    _save(args, results)
    print(json.dumps(results.get("startup_s")))


if __name__ == "__main__":
    main()
