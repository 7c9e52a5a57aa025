"""The whole offline-throughput acceptance table in one command (one H200, under 8 minutes).

    bash tools/h200_run.sh table [ARGS]                   # on the device machine
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

Writes into --out: <row>.json (offline_throughput's record) and <row>.log per row, table.json
(every arm's fields plus the ratios, targets and ceilings, and each run's command, status and
time), table.md (printed at the end) and throughput.png (if matplotlib is importable).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import ROOT, pyplot, record, run_logged, write_json

BENCH = ROOT / "benchmarks" / "offline_throughput.py"
MIX = "trace:0.55,0.40,0.05"
ARM_LABELS = {"fixed": "fixed", MIX: "mix 2.5", "gate": "gate"}
BLOCK_SIZE = 16  # the engine's default KV block size
LOOPS = 4
ROWS = {"c1": (4, 1, 1100), "c32": (64, 32, 2048), "c128": (256, 128, 4096)}

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
    scale = 0.6 if args.quick else 1.0
    plen, out_len = args.prompt_len, args.output_len
    common = {"--prompt-len": plen, "--output-len": out_len, "--prefill-chunk-size": 1024}
    rows = []
    for conc, (n, seqs, tokens) in ROWS.items():
        flags = {"--num-requests": (2 if seqs == 1 else seqs) if args.quick else n}
        flags |= {"--max-num-seqs": seqs, "--max-num-batched-tokens": tokens}
        flags["--profile-steps"] = args.profile_steps
        estimate = {"c1": 45, "c32": 55, "c128": 100}[conc] * scale
        arms = ["fixed", MIX, "gate@noprofile"]
        rows.append(Row(conc, conc, "last_exited", common | flags, arms, False, estimate))
    n, seqs, tokens = ROWS["c128"]
    pages = math.ceil((plen + out_len) / BLOCK_SIZE)
    blocks = 64 * pages * LOOPS
    flags = {"--num-requests": seqs if args.quick else n, "--max-num-seqs": seqs}
    flags |= {"--max-num-batched-tokens": tokens, "--num-kv-blocks": blocks}
    note = f"KV pressure: {blocks} blocks = 64 requests x {pages} pages x {LOOPS} planes"
    kv64 = Row("c128-kv64", "c128", "last_exited", common | flags, ["fixed", MIX], True, 70 * scale)
    rows.append(kv64)
    kv64.note = note
    splen = min(128 if args.quick else 256, plen)
    for conc, (_, seqs, tokens) in ROWS.items():
        n, batched = 2 if seqs == 1 else seqs, max(tokens, seqs * splen)
        flags = {"--prompt-len": splen, "--output-len": out_len, "--prefill-chunk-size": 1024}
        flags |= {"--num-requests": n, "--max-num-seqs": seqs, "--max-num-batched-tokens": batched}
        flags["--kv-layout"] = "shared"
        estimate = {"c1": 30, "c32": 47, "c128": 35}[conc] * scale
        note = f"SHARED: {splen}-token prompts, {n} requests (one wave), "
        note += f"max-num-batched-tokens {batched}"
        shared = Row(f"shared-{conc}", conc, "shared", flags, ["fixed", MIX], True, estimate)
        rows.append(shared)
        shared.note = note
    wanted = set(args.rows.split(",")) if args.rows else None
    return [r for r in rows if wanted is None or r.name in wanted]


def base_command(args) -> list[str]:
    cmd = [sys.executable, str(BENCH), "--shape", args.shape, "--device", args.device]
    cmd += ["--dtype", args.dtype, "--checkpoint-dir", args.checkpoint_dir, "--seed", "0"]
    return cmd + ([] if args.device.startswith("cuda") else ["--cpu-threads", "1"])


def collect(rows: list[Row], out: Path, acceptance: bool) -> list[dict]:
    table = []
    for row in rows:
        path = out / f"{row.name}.json"
        if not path.exists():  # (a stale one is deleted before its row runs)
            continue
        data = json.loads(path.read_text())
        row.errors = data.get("errors", [])
        by_label = {ARM_LABELS.get(r["arm"].split("@")[0], r["arm"]): r for r in data["results"]}
        fixed = by_label.get("fixed")
        for label, r in by_label.items():
            entry = {k: r[k] for k in r if k != "profile"}
            entry |= {"row": row.name, "concurrency": row.concurrency, "layout": row.layout}
            entry |= {"arm": label, "arm_spec": r["arm"], "note": row.note}
            entry |= {"e2e_tok_s": r["output_tokens_per_s"], "profile": r.get("profile")}
            entry |= {"decode_tok_s": r["decode_output_tokens_per_s"]}
            entry["e2e_vs_fixed"] = entry["decode_vs_fixed"] = None
            if fixed is not None and label != "fixed":
                entry["e2e_vs_fixed"] = _ratio(
                    r["output_tokens_per_s"], fixed["output_tokens_per_s"]
                )
                entry["decode_vs_fixed"] = _ratio(
                    r["decode_output_tokens_per_s"], fixed["decode_output_tokens_per_s"]
                )
            table.append(entry | _targets(row, label, entry, acceptance))
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
        ceiling, target = f"dec {dc:,} / e2e {ec:,}", f"dec >= {dt:,}, e2e >= {et:,}"
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


COLUMNS = (  # (header, entry key or profile key, digits)
    ("e2e tok/s", "e2e_tok_s", 1),
    ("decode tok/s", "decode_tok_s", 1),
    ("e2e / fixed", "e2e_vs_fixed", 2),
    ("decode / fixed", "decode_vs_fixed", 2),
    ("mean loops", "mean_loops_per_decoded_token", 2),
    ("steps", "steps", 0),
    ("host ms/step", "host_ms_per_step", 2),
    ("wait ms/step", "readback_wait_ms_per_step", 2),
    ("kv blocks", "kv_blocks", 0),
    ("max run", "max_running", 0),
    ("GPU busy", "gpu_busy_fraction", None),
    ("kernels/loop", "kernels_per_loop", 1),
    ("GPU ms/loop", "gpu_ms_per_loop", 3),
    ("GEMM ms/loop", "gemm_ms_per_loop", 3),
)


def markdown(table: list[dict], rows: list[Row], setup: dict) -> str:
    def cell(e: dict, key: str, digits) -> str:
        p = e.get("profile") or {}
        v = e[key] if key in e else p.get(key)
        if digits is None:  # the busy fraction, or why there is none
            if v is not None:
                return f"{v:.1%}"
            return "profile error" if "error" in p else ("no kernels" if p else "")
        if v is None:
            return ""
        return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"

    header = ["conc", "layout", "arm", *(c[0] for c in COLUMNS)]
    header += ["ceiling", "target", "met", "old e2e"]
    lines = [
        f"Offline throughput, {setup['shape']} ({setup['dtype']}) on {setup['device_name']}, "
        f"torch {setup.get('torch_version', '?')}; {setup['elapsed_s']:.0f} s"
        + (" (quick)" if setup["quick"] else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    for e in table:
        cells = [e["row"], e["layout"], e["arm"], *(cell(e, k, d) for _, k, d in COLUMNS)]
        met = {True: "yes", False: "NO", None: ""}[e["target_met"]]
        cells += [e["ceiling"], e["target"], met, cell(e, "old_e2e_tok_s", 1)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\ne2e: output tokens / wall time from the first add_request to the last finish; "
        "decode: tokens / wall time of steps without prefill (step_log). GPU columns: "
        "--profile-steps window of pure decode at full concurrency (busy = union of kernel "
        "intervals / kernel span). Ceilings and targets are for fixed 4 loops on the issue's "
        "workload; `met` is only judged on that workload (full mode, ouro-1.4b, CUDA)."
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
    plt = pyplot()
    if plt is None:
        return "matplotlib not importable: no plot"
    groups = [
        g
        for g in ("c1", "c32", "c128", "c128-kv64")
        if any(e["row"] in (g, f"shared-{g}") for e in table)
    ]
    series = [
        (arm, layout, color, hatch)
        for layout, hatch in (("last_exited", ""), ("shared", "//"))
        for arm, color in (("fixed", "#1f77b4"), ("mix 2.5", "#ff7f0e"), ("gate", "#2ca02c"))
        if any(e["arm"] == arm and e["layout"] == layout for e in table)
    ]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(series), 1)
    centre = (len(series) - 1) / 2
    last_exited = [i for i, s in enumerate(series) if s[1] == "last_exited"]
    for ax, key, title, index in (
        (axes[0], "e2e_tok_s", "end to end", 1),
        (axes[1], "decode_tok_s", "decode phase", 0),
    ):
        for s_index, (arm, layout, color, hatch) in enumerate(series):
            xs, ys = [], []
            for g_index, group in enumerate(groups):
                row = group if layout == "last_exited" else f"shared-{group}"
                match = [e for e in table if e["row"] == row and e["arm"] == arm]
                if match and match[0][key]:
                    xs.append(g_index + (s_index - centre) * width)
                    ys.append(match[0][key])
            label = arm + (" (SHARED)" if layout == "shared" else "")
            bars = ax.bar(xs, ys, width, color=color, hatch=hatch, label=label, alpha=0.9)
            ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=6, rotation=90)
        # ceilings and targets are for the LAST_EXITED workload: lines span only its bars
        for g_index, group in enumerate(groups):
            if group in CEILINGS and last_exited:
                left = g_index + (last_exited[0] - centre - 0.5) * width
                right = g_index + (last_exited[-1] - centre + 0.5) * width
                for values, color, style, name in (
                    (CEILINGS, "black", "--", "ceiling"),
                    (TARGETS, "red", ":", "target"),
                ):
                    label = f"{name} (fixed, LAST_EXITED)" if g_index == 0 else None
                    ax.hlines(
                        values[group][index],
                        left,
                        right,
                        colors=color,
                        linestyles=style,
                        label=label,
                    )
        ax.set_xticks(range(len(groups)), groups)
        ax.set_yscale("log")
        ax.set_ylabel("output tokens/s")
        ax.set_title(title)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("rlt offline throughput: fixed 4 loops vs mix 2.5 vs gate (SHARED hatched)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    return f"plot: {out / 'throughput.png'}"


def run_rows(args, rows: list[Row], out: Path, elapsed) -> None:
    """Run the rows in order within the budget; optional ones are skipped when their
    predicted time (estimate x the actual/estimated ratio of the rows run so far) would
    overrun it."""
    estimated_done = actual_done = 0.0
    for row in rows:
        predicted = row.estimate_s * (actual_done / estimated_done if estimated_done else 1.0)
        remaining = args.budget_s - elapsed()
        if row.optional and predicted > remaining:
            row.status = "skipped"
            row.reason = f"predicted {predicted:.0f} s > {remaining:.0f} s left of the "
            row.reason += f"{args.budget_s:.0f} s budget"
        elif args.hard_limit_s - elapsed() <= 5:
            row.status, row.reason = "skipped", "hard time limit reached"
        if row.status == "skipped":
            print(f"[{elapsed():6.1f}s] skip {row.name}: {row.reason}", flush=True)
            continue
        row.command = base_command(args) + [str(x) for kv in row.flags.items() for x in kv]
        row.command += [x for arm in row.arms for x in ("--arm", arm)]
        row.command += ["--json-out", str(out / f"{row.name}.json")]
        (out / f"{row.name}.json").unlink(missing_ok=True)  # never report a stale run
        print(
            f"[{elapsed():6.1f}s] run {row.name} ({row.layout}; arms {', '.join(row.arms)}; "
            f"predicted {predicted:.0f} s)",
            flush=True,
        )
        limit = args.hard_limit_s - elapsed()
        row.status, row.elapsed_s = run_logged(
            row.command, out / f"{row.name}.log", limit, row.name
        )
        if row.status == "timeout":
            row.reason = (
                f"killed after {row.elapsed_s:.0f} s at the {args.hard_limit_s:.0f} s limit"
            )
        print(f"[{elapsed():6.1f}s] {row.name}: {row.status} in {row.elapsed_s:.1f} s", flush=True)
        if row.status == "ok":
            estimated_done += row.estimate_s
            actual_done += row.elapsed_s


def build_parser():
    from harness import parser

    p = parser(__doc__, device="cuda", dtype=None, out=False)
    p.add_argument("--out", required=True, help="folder for the JSON, markdown and plot")
    p.add_argument("--quick", action="store_true", help="reduced run (see above)")
    p.add_argument("--budget-s", type=float, default=450.0, help="optional rows must fit it")
    p.add_argument(
        "--hard-limit-s", type=float, default=470.0, help="a row still running then is killed"
    )
    p.add_argument("--shape", default="ouro-1.4b", choices=("ouro-1.4b", "tiny"))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--prompt-len", type=int, default=None, help="default 1024 (tiny shape: 64)")
    p.add_argument(
        "--output-len", type=int, default=None, help="default 128, quick 64 (tiny: 32 / 16)"
    )
    p.add_argument("--profile-steps", type=int, default=None, help="default 20, quick 10 (tiny: 3)")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--rows", help="comma-separated subset of rows, e.g. c1,shared-c1")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: rebuild table.json/md and the plot from the <row>.json in --out",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
    acceptance = not args.quick and args.shape == "ouro-1.4b" and args.device.startswith("cuda")
    acceptance = acceptance and (args.prompt_len, args.output_len) == (1024, 128)
    rows = plan(args)

    def elapsed():
        return time.perf_counter() - start

    checkpoint_s = 0.0
    if args.table_only:
        for row in rows:
            found = (out / f"{row.name}.json").exists()
            row.status, row.reason = (
                ("ok", "") if found else ("not run", f"no {row.name}.json in {out}")
            )
    else:
        print(f"[{elapsed():6.1f}s] checkpoint ({args.shape}) in {args.checkpoint_dir}", flush=True)
        command = [*base_command(args), "--write-checkpoint-only"]
        status, _ = run_logged(command, out / "checkpoint.log", args.hard_limit_s, "checkpoint")
        if status != "ok":
            print(f"checkpoint: {status}; see {out / 'checkpoint.log'}", flush=True)
            return 1
        checkpoint_s = elapsed()
        run_rows(args, rows, out, elapsed)
    table = collect(rows, out, acceptance)
    found = [out / f"{r.name}.json" for r in rows if (out / f"{r.name}.json").exists()]
    device = json.loads(found[0].read_text()).get("device", {}) if found else {}
    setup = {k: getattr(args, k) for k in ("shape", "device", "dtype", "quick", "budget_s")}
    setup |= {"hard_limit_s": args.hard_limit_s, "checkpoint_dir": args.checkpoint_dir}
    setup |= {"device_name": device.get("device_name", args.device)}
    setup |= {"torch_version": device.get("torch"), "acceptance_workload": acceptance}
    setup |= {"checkpoint_s": round(checkpoint_s, 1), "elapsed_s": round(elapsed(), 1)}
    keys = ("layout", "optional", "status", "reason", "elapsed_s", "note", "errors")
    runs = [
        {"row": r.name, **{k: getattr(r, k) for k in keys}, "command": " ".join(r.command)}
        for r in rows
    ]
    payload = record("h200_table", args, setup=setup, runs=runs)
    payload["ceilings_fixed"] = {k: {"decode": d, "e2e": e} for k, (d, e) in CEILINGS.items()}
    payload["targets_fixed"] = {k: {"decode": d, "e2e": e} for k, (d, e) in TARGETS.items()}
    payload["targets_adaptive"] = {"mix_decode_vs_fixed": MIX_DECODE_TARGET}
    payload["targets_adaptive"] |= {"mix_e2e_vs_fixed": 1.0, "gate_within": GATE_TOLERANCE}
    write_json(out / "table.json", payload | {"rows": table})
    md = markdown(table, rows, setup)
    (out / "table.md").write_text(md)
    print(plot(table, out), flush=True)
    print(f"\n[{elapsed():6.1f}s] wrote {out}/table.json, table.md\n\n{md}", flush=True)
    return 0 if all(r.status in ("ok", "skipped", "not run") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
