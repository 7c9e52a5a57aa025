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

run by family_speed.py (bandwidth, checkpoint, then one offline_throughput.py process per row:
a clean CUDA context; none past --hard-limit-s), fixed and mix 2.5 with a --profile-steps
window. The earlier tables' optional rows are family_speed.py points now: the SHARED layout
(--concurrency 1/shared,32/shared,128/shared --prompt-len 256 --waves 1 --engine-args
"--max-num-batched-tokens 32768"), c128 under KV pressure (--engine-args "--num-kv-blocks
18432": 64 requests of 1,152 tokens x 4 planes).

--quick: 64 output tokens, one wave per concurrency (c1: 2 requests), 10 profile steps.
--shape tiny (the CPU smoke test) keeps the rows but defaults to 64-token prompts, 32 output
tokens (quick 16) and 3 profile steps.

Writes into --out family_speed.py's files (<shape>-<row>.json / .log: offline_throughput's
record and output per row; families.json / .md), table.json (every arm's fields plus the
ratios, targets and ceilings), table.md (printed at the end) and throughput.png (if
matplotlib is importable). --table-only rebuilds the last three from those files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import ROOT, pyplot, record, run_logged, write_json

MIX = "trace:0.55,0.40,0.05"
ARMS = ("fixed", MIX, "gate@noprofile")
ARM_LABELS = {"fixed": "fixed", MIX: "mix 2.5", "gate": "gate"}
ROWS = ("c1", "c32", "c128")

# Fixed 4 loops, LAST_EXITED, the workload: (decode, end to end) tok/s.
CEILINGS = {"c1": (250, 250), "c32": (3000, 2200), "c128": (4100, 2700)}
TARGETS = {"c1": (200, 180), "c32": (2200, 1500), "c128": (3000, 1900)}
MIX_DECODE_TARGET = 1.5  # decode-phase mix 2.5 / fixed
GATE_TOLERANCE = 0.03  # gate within 3% of fixed


def run_rows(args, rows: list[str], out: Path) -> tuple[str, float]:
    """family_speed.py runs the rows (the checkpoint, then one offline_throughput.py process per
    row; none past --hard-limit-s) into <out>/<shape>-<row>.json / .log."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "family_speed.py"), "--out", str(out)]
    cmd += ["--shapes", args.shape, "--device", args.device, "--dtype", args.dtype]
    cmd += ["--checkpoint-dir", args.checkpoint_dir, "--no-transformers"]
    cmd += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    cmd += ["--waves", "1" if args.quick else "2", "--budget-s", str(args.hard_limit_s)]
    cmd += ["--concurrency", ",".join(r.removeprefix("c") for r in rows)]
    cmd += [x for arm in ARMS for x in ("--arm", arm)]
    cpu = "" if args.device.startswith("cuda") else " --cpu-threads 1"
    cmd += [f"--engine-args=--profile-steps {args.profile_steps} --seed 0{cpu}"]
    return run_logged(cmd, out / "family_speed.log", args.hard_limit_s + 60, "family_speed")


def collect(args, rows: list[str], out: Path, acceptance: bool) -> tuple[list[dict], dict]:
    """The table's entries, and {row: its status line} for the rows that did not run whole."""
    table, problems = [], {}
    for row in rows:
        path = out / f"{args.shape}-{row}.json"
        if not path.exists():
            problems[row] = f"not run (no {path.name}; see family_speed.log)"
            continue
        data = json.loads(path.read_text())
        for error in data.get("errors", []):
            problems[row] = f"arm {error['arm']} failed: {error['error'][:300]}"
        by_label = {ARM_LABELS.get(r["arm"].split("@")[0], r["arm"]): r for r in data["results"]}
        fixed = by_label.get("fixed")
        for label, r in by_label.items():
            entry = {k: r[k] for k in r if k != "profile"}
            entry |= {"row": row, "concurrency": row, "layout": r["kv_layout"], "arm": label}
            entry |= {"arm_spec": r["arm"], "profile": r.get("profile")}
            entry |= {"e2e_tok_s": r["output_tokens_per_s"]}
            entry |= {"decode_tok_s": r["decode_output_tokens_per_s"]}
            entry["e2e_vs_fixed"] = entry["decode_vs_fixed"] = None
            if fixed is not None and label != "fixed":
                entry["e2e_vs_fixed"] = _ratio(r[OUT], fixed[OUT])
                entry["decode_vs_fixed"] = _ratio(r[DECODE], fixed[DECODE])
            table.append(entry | _targets(row, label, entry, acceptance))
    return table, problems


OUT, DECODE = "output_tokens_per_s", "decode_output_tokens_per_s"


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _targets(conc: str, label: str, e: dict, acceptance: bool) -> dict:
    """Ceiling, target text and whether it is met (None: not the acceptance workload)."""
    ceiling = target = ""
    met = None
    if label == "fixed":
        (dc, ec), (dt, et) = CEILINGS[conc], TARGETS[conc]
        ceiling, target = f"dec {dc:,} / e2e {ec:,}", f"dec >= {dt:,}, e2e >= {et:,}"
        if acceptance:
            met = (e["decode_tok_s"] or 0) >= dt and e["e2e_tok_s"] >= et
    elif label == "mix 2.5":
        target = f"e2e >= fixed, dec >= {MIX_DECODE_TARGET}x"
        if acceptance and e["e2e_vs_fixed"] is not None:
            met = e["e2e_vs_fixed"] >= 1.0 and (e["decode_vs_fixed"] or 0) >= MIX_DECODE_TARGET
    elif label == "gate":
        target = f"within {GATE_TOLERANCE:.0%} of fixed"
        if acceptance and e["e2e_vs_fixed"] is not None:
            met = min(e["e2e_vs_fixed"], e["decode_vs_fixed"] or 0) >= 1 - GATE_TOLERANCE
    return {"ceiling": ceiling, "target": target, "target_met": met}


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


def markdown(table: list[dict], problems: dict, setup: dict) -> str:
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
    header += ["ceiling", "target", "met"]
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
        cells += [e["ceiling"], e["target"], met]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\ne2e: output tokens / wall time from the first add_request to the last finish; "
        "decode: tokens / wall time of steps without prefill (step_log). GPU columns: "
        "--profile-steps window of pure decode at full concurrency (busy = union of kernel "
        "intervals / kernel span). Ceilings and targets are for fixed 4 loops on the issue's "
        "workload; `met` is only judged on that workload (full mode, ouro-1.4b, CUDA)."
    )
    lines += [f"- {row}: {problem}" for row, problem in problems.items()]
    return "\n".join(lines) + "\n"


def plot(table: list[dict], out: Path) -> str:
    """throughput.png: e2e and decode tok/s per row (bars per arm, log scale)."""
    plt = pyplot()
    if plt is None:
        return "matplotlib not importable: no plot"
    rows, arms = (list(dict.fromkeys(e[k] for e in table)) for k in ("row", "arm"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(arms), 1)
    for ax, key in zip(axes, ("e2e_tok_s", "decode_tok_s"), strict=True):
        for index, arm in enumerate(arms):
            shift = (index - (len(arms) - 1) / 2) * width
            mine = [e for e in table if e["arm"] == arm and e[key]]
            xs = [rows.index(e["row"]) + shift for e in mine]
            bars = ax.bar(xs, [e[key] for e in mine], width, label=arm)
            ax.bar_label(bars, fmt="%.0f", fontsize=6, rotation=90)
        ax.set_xticks(range(len(rows)), rows)
        ax.set(yscale="log", ylabel="output tokens/s", title=key)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("rlt offline throughput per row and arm (targets and ceilings: table.md)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    return f"plot: {out / 'throughput.png'}"


def build_parser():
    from harness import parser

    p = parser(__doc__, device="cuda", dtype=None, out=False)
    p.add_argument("--out", required=True, help="folder for the JSON, markdown and plot")
    p.add_argument("--quick", action="store_true", help="reduced run (see above)")
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
    p.add_argument("--rows", help="comma-separated subset of rows, e.g. c1,c128")
    p.add_argument("--table-only", action="store_true", help="rebuild from --out's <row>.json")
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
    rows = [r for r in ROWS if not args.rows or r in args.rows.split(",")]
    status, elapsed = ("not run", 0.0) if args.table_only else run_rows(args, rows, out)
    table, problems = collect(args, rows, out, acceptance)
    found = [out / f"{args.shape}-{r}.json" for r in rows if r not in problems]
    device = json.loads(found[0].read_text()).get("device", {}) if found else {}
    setup = {k: getattr(args, k) for k in ("shape", "device", "dtype", "quick")}
    setup |= {"hard_limit_s": args.hard_limit_s, "checkpoint_dir": args.checkpoint_dir}
    setup |= {"device_name": device.get("device_name", args.device)}
    setup |= {"torch_version": device.get("torch"), "acceptance_workload": acceptance}
    setup |= {"elapsed_s": round(time.perf_counter() - start, 1)}
    runs = {"family_speed": status, "elapsed_s": elapsed, "problems": problems}
    payload = record("h200_table", args, setup=setup, runs=runs)
    payload["ceilings_fixed"] = {k: {"decode": d, "e2e": e} for k, (d, e) in CEILINGS.items()}
    payload["targets_fixed"] = {k: {"decode": d, "e2e": e} for k, (d, e) in TARGETS.items()}
    payload["targets_adaptive"] = {"mix_decode_vs_fixed": MIX_DECODE_TARGET}
    payload["targets_adaptive"] |= {"mix_e2e_vs_fixed": 1.0, "gate_within": GATE_TOLERANCE}
    write_json(out / "table.json", payload | {"rows": table})
    md = markdown(table, problems, setup)
    (out / "table.md").write_text(md)
    print(plot(table, out), flush=True)
    print(f"\nwrote {out}/table.json, table.md\n\n{md}", flush=True)
    return 0 if status in ("ok", "not run") and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
