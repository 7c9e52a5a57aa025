"""`rlt ray serve` with one engine replica against `rlt serve`: the same `rlt bench serve` runs.

Issue 24's one-node check: the Ray Serve path (Serve's HTTP proxy -> the ingress deployment with
rlt-serve's app -> one engine replica, `num_gpus=1` on CUDA) should serve within 5% of `rlt
serve` (one process group: the front end and its engine core). Per arm, in --arms order: start
the server on a free port (same engine flags on both: the engine's defaults, --dtype,
--exit-threshold 1.0 so every token runs at full depth, --engine-json on top; the Ray arm adds
`--replicas 1` and --ray-args), wait for /health, send --warmup requests (not measured), then
every --points concurrency --repeats times with `rlt bench serve` (random prompts of
--input-len tokens, --output-len tokens out, ignore_eos), then stop it with SIGINT (a local Ray
cluster stops with `rlt ray serve`). Per measurement: output tokens/s, TTFT/TPOT/ITL p50 and
p99, and the CPU seconds of the server's process tree (Ray's processes included: they are
children of `rlt ray serve`). `comparison` holds per concurrency the Ray arm's figures over
`rlt serve`'s (means over the repeats) and `within_5pct`: output throughput >= 0.95x at every
concurrency. The arm `ray_process` runs the replica's engine core in a process of its own
(`--engine-process`; `ray` runs it on a thread of the replica) and gets its own
`comparison_engine_process`. Every figure goes to --out as it is measured; each server's log
to --log-dir.

    python3 benchmarks/ray_vs_serve.py /tmp/rlt-bench-checkpoints/ouro-1.4b --out r.json

On the H200: `bash tools/h200_run.sh ray-serve` (carry .whl and .whlray:
tools/fetch_device_wheels.sh ray). On a CPU (plumbing only):

    uv run python benchmarks/ray_vs_serve.py CKPT --out /tmp/r.json --device cpu \\
        --dtype float32 --input-len 32 --output-len 8 --points 2:4 --repeats 1 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from server_processes import family, free_port, run_bench_serve

FIGURES = ["output_throughput", "completed", "duration"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("median", "p99")
]


def gpu_processes() -> list[str]:
    """nvidia-smi's compute processes (pid, memory): shows which arm's engine holds the GPU."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in done.stdout.splitlines()[1:] if line.strip()]


class Server:
    """One arm's server: `rlt serve` or `rlt ray serve --replicas 1`."""

    def __init__(self, args, arm: str) -> None:
        self.arm, self.port, self.stop_timeout = arm, free_port(), args.stop_timeout
        # `python -m rlt_ray` is `rlt ray`: rlt finds that command through rlt-ray's entry
        # point, which needs rlt-ray installed (the GPU machine runs the sources on PYTHONPATH)
        command = [sys.executable, "-m"]
        ray = arm in ("ray", "ray_process")
        command += ["rlt_ray", "serve"] if ray else ["rlt.cli", "serve"]
        command += [args.model, "--port", str(self.port), "--dtype", args.dtype]
        command += ["--exit-threshold", "1.0", "--log-level", args.log_level]
        command += ["--served-model-name", "bench"]
        if args.device:
            command += ["--device", args.device]
        for key, value in json.loads(args.engine_json).items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        if ray:
            command += ["--replicas", "1", *shlex.split(args.ray_args)]
            command += ["--engine-process" if arm == "ray_process" else "--no-engine-process"]
        self.command = command
        self.log_path = Path(args.log_dir) / f"server-{arm}-{int(time.time())}.log"
        self.log = self.log_path.open("w")
        start = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = start + args.startup_timeout
        while True:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"{arm} server exited:\n{self.tail()}")
            if time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{arm} server not healthy in {args.startup_timeout} s:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        self.startup_s = time.perf_counter() - start

    def tail(self, lines: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def bench(self, args, concurrency: int | None, count: int, seed: int) -> dict:
        result, cpu = run_bench_serve(
            self.port,
            self.process.pid,
            input_len=args.input_len,
            output_len=args.output_len,
            count=count,
            seed=seed,
            concurrency=concurrency,
        )
        summary = {k: result.get(k) for k in FIGURES}
        summary["server_cpu_s"] = round(sum(cpu.values()), 2)
        return summary

    def stop(self) -> float:
        """SIGINT (what Ctrl-C sends), then whatever of its process tree is left; seconds."""
        start = time.perf_counter()
        pids = family(self.process.pid)
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            print(f"  {self.arm}: no exit {self.stop_timeout} s after SIGINT: SIGKILL", flush=True)
            self.process.kill()
            self.process.wait()
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        for pid in left:  # only processes this server started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        if left:
            print(f"  {self.arm}: killed {len(left)} leftover processes", flush=True)
        return time.perf_counter() - start


def mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def compare(results: dict, base: str = "serve", other: str = "ray") -> dict:
    arms = results["arms"]
    if base not in arms or other not in arms:
        return {}
    table = {}
    for point, a in arms[base].get("points", {}).items():
        b = arms[other].get("points", {}).get(point)
        if not b:
            continue
        row = {}
        for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms") + (
            "median_tpot_ms",
            "p99_tpot_ms",
            "server_cpu_s",
        ):
            va, vb = mean([r.get(key) for r in a]), mean([r.get(key) for r in b])
            row[key] = {base: va, other: vb, "ratio": (vb / va) if va and vb else None}
        row["throughput_each_repeat"] = {
            base: [r["output_throughput"] for r in a],
            other: [r["output_throughput"] for r in b],
        }
        table[point] = row
    ratios = [row["output_throughput"]["ratio"] for row in table.values()]
    return {
        "per_concurrency": table,
        "throughput_ratio_ray_over_serve": {
            p: r["output_throughput"]["ratio"] for p, r in table.items()
        },
        "within_5pct": bool(ratios) and all(r is not None and r >= 0.95 for r in ratios),
    }


def save(args, results: dict) -> None:
    Path(args.out).write_text(json.dumps(results, indent=1))


def run(args) -> dict:
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    results = {
        "setup": {
            "model": args.model,
            "dtype": args.dtype,
            "device": args.device or "default",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "points": args.points,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "engine_json": args.engine_json,
            "ray_args": args.ray_args,
            "arms": args.arms,
        },
        "arms": {},
    }
    for arm in args.arms.split(","):
        name = arm if arm not in results["arms"] else f"{arm}_again"
        print(f"arm {name}: starting", flush=True)
        try:
            server = Server(args, arm)
        except RuntimeError as exc:
            results["arms"][name] = {"error": str(exc)[-4000:]}
            print(f"  {name} did not start: {exc}", flush=True)
            save(args, results)
            continue
        entry = results["arms"][name] = {
            "command": shlex.join(server.command[2:]),
            "startup_s": round(server.startup_s, 1),
            "gpu_processes": gpu_processes(),
            "points": {},
        }
        print(f"  healthy after {server.startup_s:.1f} s", flush=True)
        try:
            if args.warmup:
                entry["warmup"] = server.bench(args, None, args.warmup, seed=7)
            for repeat in range(args.repeats):
                for concurrency, count in points:
                    figures = server.bench(args, concurrency, count, seed=1000 * repeat + count)
                    entry["points"].setdefault(str(concurrency), []).append(figures)
                    print(
                        f"  C={concurrency} n={count} #{repeat + 1}: "
                        f"{figures['output_throughput']:.1f} tok/s, TTFT p50 "
                        f"{figures['median_ttft_ms']:.1f} ms, TPOT p50 "
                        f"{figures['median_tpot_ms']:.2f} ms",
                        flush=True,
                    )
                    save(args, results)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["log_tail"] = server.tail()
            print(f"  {name} failed: {entry['error']}\n{entry['log_tail']}", flush=True)
        finally:
            entry["stop_s"] = round(server.stop(), 1)
            entry["log"] = str(server.log_path)
        save(args, results)
    results["comparison"] = compare(results)
    if "ray_process" in results["arms"]:
        results["comparison_engine_process"] = compare(results, "serve", "ray_process")
    if "serve_again" in results["arms"]:
        results["comparison_drift"] = compare(results, "serve", "serve_again")
    save(args, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--log-dir", default=None, help="server logs (default: --out's folder)")
    parser.add_argument(
        "--arms",
        default="serve,ray",
        help="order; 'serve,ray,serve' re-runs A; ray_process: the replica's engine core in "
        "its own process (--engine-process)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None, help="engine device (default: the engine's)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--points", default="32:128,128:384", help="C:N pairs")
    parser.add_argument("--repeats", type=int, default=2, help="of every point, per arm")
    parser.add_argument("--warmup", type=int, default=32, help="requests before measuring")
    parser.add_argument("--engine-json", default="{}", help="EngineConfig fields for both arms")
    parser.add_argument("--ray-args", default="", help="more `rlt ray serve` flags")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0, help="after SIGINT")
    args = parser.parse_args(argv)
    args.log_dir = args.log_dir or str(Path(args.out).resolve().parent)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    results = run(args)
    comparison = results.get("comparison", {})
    print(json.dumps(comparison.get("throughput_ratio_ray_over_serve")), flush=True)
    print(f"within 5%: {comparison.get('within_5pct')}", flush=True)
    return 0 if all("error" not in arm for arm in results["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
