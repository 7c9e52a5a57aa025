"""The whole offline-throughput acceptance table in one command (one H200, under 8 minutes).

    python3 benchmarks/h200_table.py --out DIR            # on the GPU machine, repo root
    python3 benchmarks/h200_table.py --out DIR --quick    # reduced run
    uv run --with matplotlib python benchmarks/h200_table.py --out /tmp/t \\
        --shape tiny --device cpu --quick                  # CPU smoke test of the plumbing

Workload (the issue's): random Ouro-1.4B-shaped checkpoint written once (bf16, random weights
generated on the GPU) under --checkpoint-dir, LAST_EXITED, 1,024-token prompts, 128 output
tokens, greedy, ignore_eos, prefill chunk 1,024; arms fixed, mix 2.5 (trace:0.55,0.40,0.05)
and gate (exit_threshold 0.999999, min_loops 2: nobody exits) side by side in one process per
row. Rows (num-requests / max-num-seqs / max-num-batched-tokens):

  c1    4 / 1 / 1100        c32   64 / 32 / 2048        c128  256 / 128 / 4096

each in its own subprocess of benchmarks/offline_throughput.py (a clean CUDA context), fixed
and mix 2.5 with a --profile-steps window. Optional rows, run in this order while the time
budget allows (skipped, and said so, when the predicted time would overrun --budget-s):

  c128 kv64   c128 with --num-kv-blocks sized so only 64 requests fit (fixed, mix 2.5)
  SHARED c1 / c32 / c128   fixed and mix 2.5 with the SHARED layout, whose prefill runs
              position by position (slow by design): 256-token prompts, one wave of requests
              (c1: 2) and max-num-batched-tokens raised to take the wave's prompts in one step;
              the exact flags are recorded in table.json ("runs").

--quick: 64 output tokens, one wave per concurrency (c1: 2 requests), 10 profile steps,
SHARED prompts of 128 tokens. --shape tiny (the CPU smoke test) keeps the rows but defaults to
64-token prompts, 32 output tokens (quick 16) and 3 profile steps.

Writes into --out: <row>.json (offline_throughput's JSON) and <row>.log per row, table.json
(every arm's fields plus the ratios, targets and ceilings, and each run's command, status and
time), table.md (printed at the end) and throughput.png (if matplotlib is importable). Needs
torch; the packages' src folders are put on the children's PYTHONPATH, and if msgspec is not
importable, a msgspec wheel under .whl/ (matching this Python) is unpacked into a temp folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "offline_throughput.py"
MIX = "trace:0.55,0.40,0.05"
ARM_LABELS = {"fixed": "fixed", MIX: "mix 2.5", "gate": "gate"}
BLOCK_SIZE = 16  # the engine's default KV block size
LOOPS = 4

# Fixed 4 loops, LAST_EXITED, the workload: (decode, end to end) tok/s.
CEILINGS = {"c1": (250, 250), "c32": (3000, 2200), "c128": (4100, 2700)}
TARGETS = {"c1": (200, 180), "c32": (2200, 1500), "c128": (3000, 1900)}
HISTORY_E2E = {  # previous engine, end to end tok/s
    ("c1", "fixed"): 57.4,
    ("c32", "fixed"): 813,
    ("c128", "fixed"): 1410,
    ("c1", "mix 2.5"): 88.2,
    ("c32", "mix 2.5"): 1080,
    ("c128", "mix 2.5"): 477,
}
MIX_DECODE_TARGET = 1.5  # decode-phase mix 2.5 / fixed
GATE_TOLERANCE = 0.03  # gate within 3% of fixed


@dataclass
class Row:
    name: str  # file stem, e.g. c32, c128-kv64, shared-c32
    concurrency: str  # c1 / c32 / c128
    layout: str
    flags: dict
    arms: list[str]
    optional: bool
    estimate_s: float  # on an H200, full mode
    note: str = ""
    status: str = "pending"
    reason: str = ""
    elapsed_s: float = 0.0
    command: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # arms that failed (offline_throughput)


def plan(args) -> list[Row]:
    quick = args.quick
    out_len, plen = args.output_len, args.prompt_len
    seq_len = plen + out_len
    common = {"--prompt-len": plen, "--output-len": out_len, "--prefill-chunk-size": 1024}
    spec = {"c1": (4, 1, 1100), "c32": (64, 32, 2048), "c128": (256, 128, 4096)}
    prof = ["fixed", MIX, "gate@noprofile"]
    estimates = {"c1": 45, "c32": 55, "c128": 100}
    rows = []
    for conc, (n, seqs, tokens) in spec.items():
        if quick:
            n = 2 if seqs == 1 else seqs
        rows.append(
            Row(
                conc,
                conc,
                "last_exited",
                {
                    **common,
                    "--num-requests": n,
                    "--max-num-seqs": seqs,
                    "--max-num-batched-tokens": tokens,
                    "--profile-steps": args.profile_steps,
                },
                prof,
                optional=False,
                estimate_s=estimates[conc] * (0.6 if quick else 1.0),
            )
        )
    n, seqs, tokens = spec["c128"]
    if quick:
        n = seqs
    fit = 64
    blocks = fit * math.ceil(seq_len / BLOCK_SIZE) * LOOPS
    rows.append(
        Row(
            "c128-kv64",
            "c128",
            "last_exited",
            {
                **common,
                "--num-requests": n,
                "--max-num-seqs": seqs,
                "--max-num-batched-tokens": tokens,
                "--num-kv-blocks": blocks,
            },
            ["fixed", MIX],
            optional=True,
            estimate_s=70 * (0.6 if quick else 1.0),
            note=f"KV pressure: {blocks} blocks = {fit} requests x "
            f"{math.ceil(seq_len / BLOCK_SIZE)} pages x {LOOPS} planes",
        )
    )
    splen = min(128 if quick else 256, plen)
    for conc, (_, seqs, tokens) in spec.items():
        n = 2 if seqs == 1 else seqs
        batched = max(tokens, seqs * splen)
        rows.append(
            Row(
                f"shared-{conc}",
                conc,
                "shared",
                {
                    "--prompt-len": splen,
                    "--output-len": out_len,
                    "--prefill-chunk-size": 1024,
                    "--num-requests": n,
                    "--max-num-seqs": seqs,
                    "--max-num-batched-tokens": batched,
                    "--kv-layout": "shared",
                },
                ["fixed", MIX],
                optional=True,
                estimate_s={"c1": 30, "c32": 47, "c128": 35}[conc] * (0.6 if quick else 1.0),
                note=f"SHARED: {splen}-token prompts, {n} requests (one wave), "
                f"max-num-batched-tokens {batched}",
            )
        )
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [r for r in rows if r.name in wanted]
    return rows


# -- environment -----------------------------------------------------------------------------------
def child_env() -> dict:
    env = dict(os.environ)
    paths = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    paths += [str(p) for p in sorted((ROOT / "services").glob("*/src"))]
    if importlib.util.find_spec("msgspec") is None:
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        wheels = sorted((ROOT / ".whl").glob(f"msgspec-*-{tag}-*.whl"))
        if not wheels:
            raise SystemExit(
                f"msgspec is not importable and no .whl/msgspec-*-{tag}-*.whl to unpack"
            )
        site = Path(tempfile.gettempdir()) / f"rlt-site-{tag}"
        if not (site / "msgspec").is_dir():
            with zipfile.ZipFile(wheels[-1]) as wheel:
                wheel.extractall(site)
        print(f"msgspec: unpacked {wheels[-1].name} into {site}", flush=True)
        paths.insert(0, str(site))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def base_command(args) -> list[str]:
    cmd = [sys.executable, str(BENCH), "--shape", args.shape, "--device", args.device]
    cmd += ["--dtype", args.dtype, "--checkpoint-dir", args.checkpoint_dir, "--seed", "0"]
    if not args.device.startswith("cuda"):
        cmd += ["--cpu-threads", "1"]
    return cmd


def run_child(cmd: list[str], env: dict, log_path: Path, prefix: str, timeout_s: float) -> str:
    """Run `cmd`, echo its output with `prefix` and save it; -> "ok", "failed" or "timeout"."""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def pump():
            for line in proc.stdout:
                log.write(line)
                if "USDT:" in line or "DeviceProperties.cpp" in line:
                    continue  # profiler chatter
                print(f"  [{prefix}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)
            return "timeout"
        reader.join(5)
    return "ok" if rc == 0 else f"failed (exit {rc})"


# -- table -----------------------------------------------------------------------------------------
def collect(rows: list[Row], out: Path, acceptance: bool) -> list[dict]:
    table = []
    for row in rows:
        path = out / f"{row.name}.json"
        if not path.exists():  # (a stale one is deleted before its row runs)
            continue
        data = json.loads(path.read_text())
        row.errors = data.get("errors", [])
        results = data["results"]
        by_label = {}
        for r in results:
            label = ARM_LABELS.get(r["arm"].split("@")[0], r["arm"])
            by_label[label] = r
        fixed = by_label.get("fixed")
        for label, r in by_label.items():
            entry = {
                **{k: r[k] for k in r if k != "profile"},
                "row": row.name,
                "concurrency": row.concurrency,
                "layout": row.layout,
                "arm": label,
                "arm_spec": r["arm"],
                "e2e_tok_s": r["output_tokens_per_s"],
                "decode_tok_s": r["decode_output_tokens_per_s"],
                "e2e_vs_fixed": None,
                "decode_vs_fixed": None,
                "note": row.note,
                "profile": r.get("profile"),
            }
            if fixed is not None and label != "fixed":
                entry["e2e_vs_fixed"] = _ratio(
                    r["output_tokens_per_s"], fixed["output_tokens_per_s"]
                )
                entry["decode_vs_fixed"] = _ratio(
                    r["decode_output_tokens_per_s"], fixed["decode_output_tokens_per_s"]
                )
            entry.update(_targets(row, label, entry, acceptance))
            table.append(entry)
    return table


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _targets(row: Row, label: str, e: dict, acceptance: bool) -> dict:
    """Ceiling, target text and whether it is met (None: not the acceptance workload)."""
    conc = row.concurrency
    standard = row.layout == "last_exited" and row.name == conc
    ceiling = target = ""
    met = None
    if label == "fixed" and standard:
        (dc, ec), (dt, et) = CEILINGS[conc], TARGETS[conc]
        ceiling = f"dec {dc:,} / e2e {ec:,}"
        target = f"dec >= {dt:,}, e2e >= {et:,}"
        if acceptance:
            met = (e["decode_tok_s"] or 0) >= dt and e["e2e_tok_s"] >= et
    elif label == "mix 2.5":
        target = "e2e >= fixed" + (f", dec >= {MIX_DECODE_TARGET}x" if row.name == conc else "")
        if acceptance and e["e2e_vs_fixed"] is not None:
            met = e["e2e_vs_fixed"] >= 1.0
            if row.name == conc:
                met = met and (e["decode_vs_fixed"] or 0) >= MIX_DECODE_TARGET
    elif label == "gate":
        target = f"within {GATE_TOLERANCE:.0%} of fixed"
        if acceptance and e["e2e_vs_fixed"] is not None:
            met = min(e["e2e_vs_fixed"], e["decode_vs_fixed"] or 0) >= 1 - GATE_TOLERANCE
    history = HISTORY_E2E.get((conc, label)) if standard else None
    return {"ceiling": ceiling, "target": target, "target_met": met, "old_e2e_tok_s": history}


def markdown(table: list[dict], rows: list[Row], setup: dict) -> str:
    def f(v, digits=1):
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:,.{digits}f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = [
        f"Offline throughput, {setup['shape']} ({setup['dtype']}) on {setup['device_name']}, "
        f"torch {setup.get('torch_version', '?')}; {setup['elapsed_s']:.0f} s"
        + (" (quick)" if setup["quick"] else ""),
        "",
        "| conc | layout | arm | e2e tok/s | decode tok/s | e2e / fixed | decode / fixed "
        "| mean loops | steps | host ms/step | wait ms/step | kv blocks | max run "
        "| GPU busy | kernels/loop | GPU ms/loop | GEMM ms/loop | ceiling | target | met "
        "| old e2e |",
        "|" + " --- |" * 20,
    ]
    for e in table:
        p = e.get("profile") or {}
        met = {True: "yes", False: "NO", None: ""}[e["target_met"]]
        busy = p.get("gpu_busy_fraction")
        lines.append(
            "| "
            + " | ".join(
                [
                    e["row"],
                    e["layout"],
                    e["arm"],
                    f(e["e2e_tok_s"]),
                    f(e["decode_tok_s"]),
                    f(e["e2e_vs_fixed"], 2),
                    f(e["decode_vs_fixed"], 2),
                    f(e["mean_loops_per_decoded_token"], 2),
                    f(e["steps"]),
                    f(e["host_ms_per_step"], 2),
                    f(e["readback_wait_ms_per_step"], 2),
                    f(e["kv_blocks"]),
                    f(e["max_running"]),
                    f"{busy:.1%}"
                    if busy is not None
                    else ("profile error" if "error" in p else ("no kernels" if p else "")),
                    f(p.get("kernels_per_loop")),
                    f(p.get("gpu_ms_per_loop"), 3),
                    f(p.get("gemm_ms_per_loop"), 3),
                    e["ceiling"],
                    e["target"],
                    met,
                    f(e["old_e2e_tok_s"]),
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append(
        "e2e: output tokens / wall time from the first add_request to the last finish; decode: "
        "tokens / wall time of steps without prefill (step_log). GPU columns: --profile-steps "
        "window of pure decode at full concurrency (busy = union of kernel intervals / kernel "
        "span). Ceilings and targets are for fixed 4 loops on the issue's workload; `met` is "
        "only judged on that workload (full mode, ouro-1.4b, CUDA)."
    )
    for row in rows:
        if row.status != "ok":
            lines.append(f"- {row.name}: {row.status}{': ' + row.reason if row.reason else ''}")
        for error in row.errors:
            lines.append(f"- {row.name}: arm {error['arm']} failed: {error['error'][:300]}")
        if row.note and row.status == "ok":
            lines.append(f"- {row.name}: {row.note}")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot"
    groups = [
        g
        for g in ("c1", "c32", "c128", "c128-kv64")
        if any(e["row"] in (g, f"shared-{g}") for e in table)
    ]
    series = [
        ("fixed", "last_exited", "#1f77b4", ""),
        ("mix 2.5", "last_exited", "#ff7f0e", ""),
        ("gate", "last_exited", "#2ca02c", ""),
        ("fixed", "shared", "#1f77b4", "//"),
        ("mix 2.5", "shared", "#ff7f0e", "//"),
    ]
    series = [s for s in series if any(e["arm"] == s[0] and e["layout"] == s[1] for e in table)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(series), 1)
    for ax, key, title, ceil_index, target_index in (
        (axes[0], "e2e_tok_s", "end to end", 1, 1),
        (axes[1], "decode_tok_s", "decode phase", 0, 0),
    ):
        for s_index, (arm, layout, color, hatch) in enumerate(series):
            xs, ys = [], []
            for g_index, group in enumerate(groups):
                row = group if layout == "last_exited" else f"shared-{group}"
                match = [e for e in table if e["row"] == row and e["arm"] == arm]
                if match and match[0][key]:
                    xs.append(g_index + (s_index - (len(series) - 1) / 2) * width)
                    ys.append(match[0][key])
            label = arm + (" (SHARED)" if layout == "shared" else "")
            bars = ax.bar(xs, ys, width, color=color, hatch=hatch, label=label, alpha=0.9)
            ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=6, rotation=90)
        # ceilings and targets are for the LAST_EXITED workload: lines span only its bars
        last_exited = [i for i, s in enumerate(series) if s[1] == "last_exited"]
        centre = (len(series) - 1) / 2
        for g_index, group in enumerate(groups):
            if group in CEILINGS and last_exited:
                left = g_index + (last_exited[0] - centre - 0.5) * width
                right = g_index + (last_exited[-1] - centre + 0.5) * width
                ax.hlines(
                    CEILINGS[group][ceil_index],
                    left,
                    right,
                    colors="black",
                    linestyles="--",
                    label="ceiling (fixed, LAST_EXITED)" if g_index == 0 else None,
                )
                ax.hlines(
                    TARGETS[group][target_index],
                    left,
                    right,
                    colors="red",
                    linestyles=":",
                    label="target (fixed, LAST_EXITED)" if g_index == 0 else None,
                )
        ax.set_xticks(range(len(groups)), groups)
        ax.set_yscale("log")
        ax.set_ylabel("output tokens/s")
        ax.set_title(title)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("rlt offline throughput: fixed 4 loops vs mix 2.5 vs gate (SHARED hatched)")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def run_rows(args, rows: list[Row], out: Path, env: dict, elapsed) -> None:
    """Run the rows in order within the budget; optional ones are skipped when their
    predicted time (estimate x the actual/estimated ratio of the rows run so far) would
    overrun it."""
    estimated_done = actual_done = 0.0
    for row in rows:
        scale = actual_done / estimated_done if estimated_done else 1.0
        predicted = row.estimate_s * scale
        remaining = args.budget_s - elapsed()
        if row.optional and predicted > remaining:
            row.status = "skipped"
            row.reason = (
                f"predicted {predicted:.0f} s > {remaining:.0f} s left of the "
                f"{args.budget_s:.0f} s budget"
            )
            print(f"[{elapsed():6.1f}s] skip {row.name}: {row.reason}", flush=True)
            continue
        if args.hard_limit_s - elapsed() <= 5:
            row.status, row.reason = "skipped", "hard time limit reached"
            print(f"[{elapsed():6.1f}s] skip {row.name}: {row.reason}", flush=True)
            continue
        row.command = [*base_command(args)]
        for flag, value in row.flags.items():
            row.command += [flag, str(value)]
        for arm in row.arms:
            row.command += ["--arm", arm]
        row.command += ["--json-out", str(out / f"{row.name}.json")]
        (out / f"{row.name}.json").unlink(missing_ok=True)  # never report a stale run
        print(
            f"[{elapsed():6.1f}s] run {row.name} ({row.layout}; arms {', '.join(row.arms)}; "
            f"predicted {predicted:.0f} s)",
            flush=True,
        )
        t0 = time.perf_counter()
        limit = args.hard_limit_s - elapsed()
        row.status = run_child(row.command, env, out / f"{row.name}.log", row.name, limit)
        row.elapsed_s = round(time.perf_counter() - t0, 1)
        if row.status == "timeout":
            row.reason = (
                f"killed after {row.elapsed_s:.0f} s at the {args.hard_limit_s:.0f} s limit"
            )
        print(f"[{elapsed():6.1f}s] {row.name}: {row.status} in {row.elapsed_s:.1f} s", flush=True)
        if row.status == "ok":
            estimated_done += row.estimate_s
            actual_done += row.elapsed_s


# -- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the JSON, markdown and plot")
    parser.add_argument("--quick", action="store_true", help="reduced run (see above)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="time budget: optional rows are skipped when they are predicted to overrun it",
    )
    parser.add_argument(
        "--hard-limit-s",
        type=float,
        default=470.0,
        help="any row still running at this total time is killed (and reported as such)",
    )
    parser.add_argument("--shape", default="ouro-1.4b", choices=("ouro-1.4b", "tiny"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="default 1024 (tiny shape: 64)"
    )
    parser.add_argument(
        "--output-len", type=int, default=None, help="default 128, quick 64 (tiny: 32 / 16)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=None, help="default 20, quick 10 (tiny: 3)"
    )
    parser.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    parser.add_argument("--rows", help="comma-separated subset of rows, e.g. c1,shared-c1")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: rebuild table.json/md and the plot from the <row>.json in --out "
        "(e.g. after rows were run in separate calls with --rows)",
    )
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    tiny = args.shape == "tiny"  # CPU smoke scale: same rows, short sequences
    if args.prompt_len is None:
        args.prompt_len = 64 if tiny else 1024
    if args.output_len is None:
        args.output_len = (16 if args.quick else 32) if tiny else (64 if args.quick else 128)
    if args.profile_steps is None:
        args.profile_steps = 3 if tiny else (10 if args.quick else 20)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {} if args.table_only else child_env()
    acceptance = (
        not args.quick
        and args.shape == "ouro-1.4b"
        and args.device.startswith("cuda")
        and args.prompt_len == 1024
        and args.output_len == 128
    )
    rows = plan(args)

    def elapsed():
        return time.perf_counter() - start

    checkpoint_s = 0.0
    if args.table_only:
        for row in rows:
            found = (out / f"{row.name}.json").exists()
            row.status = "ok" if found else "not run"
            row.reason = "" if found else f"no {row.name}.json in {out}"
    else:
        print(f"[{elapsed():6.1f}s] checkpoint ({args.shape}) in {args.checkpoint_dir}", flush=True)
        status = run_child(
            [*base_command(args), "--write-checkpoint-only"],
            env,
            out / "checkpoint.log",
            "checkpoint",
            args.hard_limit_s,
        )
        if status != "ok":
            print(f"checkpoint: {status}; see {out / 'checkpoint.log'}", flush=True)
            return 1
        checkpoint_s = elapsed()
        run_rows(args, rows, out, env, elapsed)
    table = collect(rows, out, acceptance)
    first = next(
        (
            json.loads((out / f"{r.name}.json").read_text())["setup"]
            for r in rows
            if (out / f"{r.name}.json").exists()
        ),
        {},
    )
    setup = {
        "shape": args.shape,
        "device": args.device,
        "device_name": first.get("device_name", args.device),
        "torch_version": first.get("torch_version"),
        "dtype": args.dtype,
        "quick": args.quick,
        "acceptance_workload": acceptance,
        "budget_s": args.budget_s,
        "hard_limit_s": args.hard_limit_s,
        "checkpoint_s": round(checkpoint_s, 1),
        "elapsed_s": round(elapsed(), 1),
        "checkpoint_dir": args.checkpoint_dir,
    }
    (out / "table.json").write_text(
        json.dumps(
            {
                "setup": setup,
                "runs": [
                    {
                        "row": r.name,
                        "layout": r.layout,
                        "optional": r.optional,
                        "status": r.status,
                        "reason": r.reason,
                        "elapsed_s": r.elapsed_s,
                        "note": r.note,
                        "errors": r.errors,
                        "command": " ".join(r.command),
                    }
                    for r in rows
                ],
                "ceilings_fixed": {k: {"decode": d, "e2e": e} for k, (d, e) in CEILINGS.items()},
                "targets_fixed": {k: {"decode": d, "e2e": e} for k, (d, e) in TARGETS.items()},
                "targets_adaptive": {
                    "mix_decode_vs_fixed": MIX_DECODE_TARGET,
                    "mix_e2e_vs_fixed": 1.0,
                    "gate_within": GATE_TOLERANCE,
                },
                "rows": table,
            },
            indent=2,
        )
    )
    md = markdown(table, rows, setup)
    (out / "table.md").write_text(md)
    print(plot(table, out), flush=True)
    print(f"\n[{elapsed():6.1f}s] wrote {out}/table.json, table.md\n", flush=True)
    print(md, flush=True)
    return 0 if all(r.status in ("ok", "skipped", "not run") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
