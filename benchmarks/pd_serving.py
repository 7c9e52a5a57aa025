"""PD disaggregation against colocated replicas, served end to end at the same request rates.

What it measures: for each configuration it starts the coordinator with its engine instances,
waits for /health, sends a few untimed warm-up requests, then runs `rlt bench serve` (streaming
OpenAI completions, vLLM-compatible metrics) once per request rate with the same seeded
prompts, and stops the group with SIGINT:

    pd        rlt pd serve [MODEL] --num-prefill 1 --num-decode 1   (KV over NIXL from P to D)
    replicas  rlt pd serve [MODEL] --replicas 2                     (the plain router baseline)

Both use the same engine flags (everything after `--` on this command line is appended to both
`rlt pd serve` commands, i.e. passed to every engine instance) and the same devices: the
coordinator assigns `--device` round-robin, prefill instances first, then decode, then replicas,
so `--device cuda:0,cuda:1` puts P on cuda:0 and D on cuda:1, and the two replicas on cuda:0
and cuda:1. Per rate it collects TTFT, ITL and TPOT p50/p99 (ms), E2E p50, output and request
throughput and failures into one JSON, and prints a side-by-side table with PD / replicas
ratios (below 1 is better for latencies, above 1 for throughput). The engine children get
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink
multicast stays off; harmless on CPU).

CPU (the bundled tiny model; ~4 minutes on 2 cores):

    uv run python benchmarks/pd_serving.py --quick --out benchmarks/results/pd_serving_cpu.json

`--quick` = input 64 / output 16 tokens, 16 prompts per rate, rates 0.5,1,2 and the engine flags
`--dtype float32 --max-num-seqs 8` unless given after `--`. On a 2-core machine the
coordinator, two engine processes and the load generator share the cores: the comparison
says more about CPU contention than about PD.

GPU (machine kind `nvidia-h200-x2`; NIXL as slim wheels, see tools/repack_nixl_wheel.py
and benchmarks/pd_transfer.py for the carry and install steps; the checkpoint must be in the
working tree or carried, e.g. Ouro-1.4B):

    python3 benchmarks/pd_serving.py /path/to/Ouro-1.4B --device cuda:0,cuda:1 \\
        --input-len 512 --output-len 64 --num-prompts 200 --rates 2,4,8,16 \\
        --out $OUT/pd_serving_h200.json -- --dtype bfloat16 --max-num-seqs 64

Defaults without `--quick`: input 512 / output 64, 200 prompts per rate, rates 1,2,4,8,
fixed lengths (`--range-ratio 0`), `--ignore-eos`, greedy. `--configs pd` or `replicas` runs
one side only; `--num-prefill/--num-decode/--replicas` change the group sizes; `--bench-arg`
passes extra flags to every `rlt bench serve` (e.g. `--bench-arg=--max-concurrency=32`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NIXL_LOG_LEVEL": "WARN",
    "PYTHONUNBUFFERED": "1",
}
QUICK_ENGINE_FLAGS = ["--dtype", "float32", "--max-num-seqs", "8"]
# (label, bench key): ms latencies, then throughputs
METRICS = [
    ("TTFT p50 ms", "p50_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("ITL p50 ms", "p50_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
    ("TPOT p50 ms", "p50_tpot_ms"),
    ("TPOT p99 ms", "p99_tpot_ms"),
    ("E2E p50 ms", "p50_e2el_ms"),
    ("output tok/s", "output_throughput"),
    ("requests/s", "request_throughput"),
]
KEEP = [key for _, key in METRICS] + [
    "completed",
    "failed",
    "not_sent",
    "errors_by_kind",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "total_token_throughput",
    "mean_ttft_ms",
    "mean_itl_ms",
    "mean_tpot_ms",
    "p90_ttft_ms",
    "p90_itl_ms",
    "p90_tpot_ms",
    "p99_e2el_ms",
    "mean_loops_per_token",
    "request_rate",
    "max_concurrency",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ)
    env.update(CHILD_ENV)
    return env


class Group:
    """One `rlt pd serve` process (its own session, so that only we stop it)."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path) -> None:
        self.name, self.command, self.port, self.log_path = name, command, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float) -> float:
        started = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=5, trust_env=False) as http:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: rlt pd serve exited with {self.process.returncode}\n"
                        + self.log_tail()
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/health").status_code == 200:
                        return time.monotonic() - started
                if time.monotonic() - started > timeout:
                    raise RuntimeError(
                        f"{self.name}: not healthy within {timeout:g} s\n" + self.log_tail()
                    )
                time.sleep(0.5)

    def instances(self) -> list[dict]:
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as http:
            return http.get("/v1/pd/instances").json().get("instances", [])

    def log_tail(self, lines: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: no exit after SIGINT; killing its group", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.log.close()
        return self.process.returncode


def bench_command(args, url: str, rate: str, num_prompts: int, result_dir, filename) -> list:
    command = [sys.executable, "-m", "rlt.cli", "bench", "serve", "--base-url", url]
    command += ["--dataset-name", "random", "--num-prompts", str(num_prompts)]
    command += ["--random-input-len", str(args.input_len)]
    command += ["--random-output-len", str(args.output_len)]
    command += ["--random-range-ratio", str(args.range_ratio), "--seed", str(args.seed)]
    command += ["--ignore-eos", "--request-rate", rate, "--disable-tqdm"]
    command += ["--metric-percentiles", "50,90,99"]
    if result_dir is not None:
        command += ["--save-result", "--result-dir", str(result_dir)]
        command += ["--result-filename", filename]
    return command + list(args.bench_arg)


def run_config(name: str, group_flags: list[str], args, work: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "rlt.cli", "pd", "serve"]
    command += [args.model] if args.model else []
    command += group_flags + ["--port", str(port), "--device", args.device]
    command += ["--log-level", "warning", "--instance-log-level", "warning"]
    command += args.engine_flags
    print(f"[{name}] {' '.join(command)}", file=sys.stderr)
    group = Group(name, command, port, work / f"{name}.log")
    record: dict = dict(command=command, rates={})
    try:
        record["startup_s"] = group.wait_healthy(args.startup_timeout)
        record["instances"] = [
            {k: i.get(k) for k in ("name", "role", "url", "state", "credits")}
            for i in group.instances()
        ]
        print(f"[{name}] healthy after {record['startup_s']:.1f} s", file=sys.stderr)
        if args.warmup_prompts:
            warm = bench_command(args, group.url, "inf", args.warmup_prompts, None, None)
            subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, env=child_env())
        for rate in args.rates:
            filename = f"{name}-rate{rate}.json"
            command = bench_command(args, group.url, rate, args.num_prompts, work, filename)
            print(f"[{name}] rate {rate}: rlt bench serve ...", file=sys.stderr)
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env()
            )
            path = work / filename
            if done.returncode != 0 or not path.exists():
                tail = done.stdout.decode(errors="replace")[-3000:]
                raise RuntimeError(f"{name}: rlt bench serve failed ({done.returncode})\n{tail}")
            result = json.loads(path.read_text())
            summary = {key: result.get(key) for key in KEEP}
            record["rates"][rate] = summary
            print(
                f"[{name}] rate {rate}: {summary['completed']} ok, {summary['failed']} failed, "
                f"TTFT p50 {_fmt(summary['p50_ttft_ms'])} ms, ITL p50 "
                f"{_fmt(summary['p50_itl_ms'])} ms, {_fmt(summary['output_throughput'])} tok/s",
                file=sys.stderr,
            )
    except Exception as error:
        record["error"] = str(error)
        print(f"[{name}] FAILED: {error}", file=sys.stderr)
    finally:
        record["exit_code"] = group.stop()
        if record["exit_code"] not in (0, None) and "error" not in record:
            record["error"] = f"rlt pd serve exited with {record['exit_code']}"
        record["log_tail"] = group.log_tail(20)
    return record


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"


def markdown(report: dict) -> str:
    configs = report["configs"]
    pd, replicas = configs.get("pd", {}), configs.get("replicas", {})
    c = report["config"]
    head = (
        f"PD ({c['num_prefill']}P+{c['num_decode']}D) vs {c['replicas']} replicas on "
        f"{c['device']}; random prompts {c['input_len']} in / {c['output_len']} out, "
        f"{c['num_prompts']} per rate; engine flags: {' '.join(c['engine_flags']) or '(none)'}"
    )
    lines = [head, "", "| rate | metric | PD | replicas | PD / replicas |", "| ---: | --- "
             "| ---: | ---: | ---: |"]  # fmt: skip
    for rate in c["rates"]:
        a, b = pd.get("rates", {}).get(rate, {}), replicas.get("rates", {}).get(rate, {})
        for label, key in [*METRICS, ("completed / failed", None)]:
            if key is None:
                left = f"{a.get('completed', '-')} / {a.get('failed', '-')}" if a else "-"
                right = f"{b.get('completed', '-')} / {b.get('failed', '-')}" if b else "-"
                lines.append(f"| {rate} | {label} | {left} | {right} | |")
                continue
            x, y = a.get(key), b.get(key)
            ratio = f"{x / y:.2f}" if x is not None and y else "-"
            lines.append(f"| {rate} | {label} | {_fmt(x)} | {_fmt(y)} | {ratio} |")
    for name, record in configs.items():
        if record.get("error"):
            lines.append(f"\n{name}: FAILED: {record['error'].splitlines()[0]}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_flags = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_flags = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [MODEL] [options] [-- engine flags for both rlt pd serve commands]",
        epilog="The module docstring (top of this file) explains the runs on CPU and GPU.",
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory (omitted: the bundled model)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="--device of `rlt pd serve` (default cpu; GPU: cuda:0,cuda:1)",
    )
    parser.add_argument("--configs", default="pd,replicas", help="pd and/or replicas (both)")
    parser.add_argument("--num-prefill", type=int, default=1, help="PD prefill instances (1)")
    parser.add_argument("--num-decode", type=int, default=1, help="PD decode instances (1)")
    parser.add_argument("--replicas", type=int, default=2, help="baseline replicas (2)")
    parser.add_argument(
        "--rates", default=None, help="request rates in req/s, comma-separated (1,2,4,8)"
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per rate (200)")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (512)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (64)")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths vary by +-ratio (0: fixed)"
    )
    parser.add_argument(
        "--warmup-prompts", type=int, default=4, help="untimed requests, all at once (4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (0)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU-sized run: 64 in / 16 out, 16 prompts, rates 0.5,1,2, engine flags "
        f"{' '.join(QUICK_ENGINE_FLAGS)} (each unless given)",
    )
    parser.add_argument(
        "--bench-arg", action="append", default=[], help="extra `rlt bench serve` flag (repeatable)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds until /health (900)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="logs and raw bench JSON (a temporary folder)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = parser.parse_args(argv)
    quick = dict(rates="0.5,1,2", num_prompts=16, input_len=64, output_len=16)
    full = dict(rates="1,2,4,8", num_prompts=200, input_len=512, output_len=64)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick and not engine_flags:
        engine_flags = list(QUICK_ENGINE_FLAGS)
    args.engine_flags = engine_flags
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(args.configs) - {"pd", "replicas"} or not args.configs:
        parser.error(f"--configs: pd and/or replicas, got {args.configs}")
    args.argv = argv + (["--", *engine_flags] if engine_flags else [])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pd_serving-"))
    work.mkdir(parents=True, exist_ok=True)
    groups = {
        "pd": ["--num-prefill", str(args.num_prefill), "--num-decode", str(args.num_decode)],
        "replicas": ["--replicas", str(args.replicas)],
    }
    started = time.monotonic()
    load_before = os.getloadavg()
    configs = {name: run_config(name, groups[name], args, work) for name in args.configs}
    report = dict(
        benchmark="pd_serving",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        command=" ".join(["benchmarks/pd_serving.py", *args.argv]),
        host=dict(
            hostname=socket.gethostname(),
            cpus=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
            load_average_before=load_before,
            load_average_after=os.getloadavg(),
        ),
        config=dict(
            model=args.model or "(bundled)",
            device=args.device,
            num_prefill=args.num_prefill,
            num_decode=args.num_decode,
            replicas=args.replicas,
            rates=args.rates,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            warmup_prompts=args.warmup_prompts,
            seed=args.seed,
            engine_flags=args.engine_flags,
            bench_args=args.bench_arg,
            child_env=CHILD_ENV,
        ),
        configs=configs,
        ratios={
            rate: {
                key: (a[key] / b[key] if a.get(key) is not None and b.get(key) else None)
                for _, key in METRICS
            }
            for rate in args.rates
            if (a := configs.get("pd", {}).get("rates", {}).get(rate))
            and (b := configs.get("replicas", {}).get("rates", {}).get(rate))
        },
        wall_s=time.monotonic() - started,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out} (logs and raw results in {work})", file=sys.stderr)
    print(markdown(report))
    return 1 if any(r.get("error") for r in configs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
