"""The figures docs/ shows, drawn from recorded results (needs matplotlib):

    uv run --with matplotlib python benchmarks/plots.py fp8            # docs/assets/fp8-h200.png
    uv run --with matplotlib python benchmarks/plots.py speculative    # .../speculative-h200.png
    uv run --with matplotlib python benchmarks/plots.py serving-sweeps \\
        --sweep "threshold 1.0" DIR1 --sweep "threshold 0.5" DIR2 --out docs/assets/sweep.png

fp8: decode tok/s of each arm at 1 and 128 requests (benchmarks/results/fp8_h200/fp8_c1.json
and fp8_c128.json, `tools/h200_run.sh fp8 c`).
speculative: left, decode speed-up over plain decoding at one request (Ouro-1.4B shape, fixed
depth) against the forced per-draft acceptance alpha, one line per (K drafts, D draft loops)
(results/speculative_h200/c1_grid_fused.json); right, K = 3, D = 1 at alpha 0.9 against the
number of concurrent requests, decode and end to end (concurrency_sweep_k3.json); the default
disable limit pauses speculation above 16 requests.
serving-sweeps: several `rlt bench serve` request-rate sweeps overlaid, each DIR holding the
result JSONs one sweep saved (`--sweep-request-rates ... --save-result --result-dir DIR`):
TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed) and output throughput against the
request rate; the legend gives each sweep's mean loops per token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import ROOT, parser, pyplot

RESULTS, ASSETS = ROOT / "benchmarks" / "results", ROOT / "docs" / "assets"
FP8_LABELS = {
    "fixed": "bf16",
    "fixed@fp8": "fp8 weights",
    "trace:0.55,0.40,0.05": "bf16, mix 2.5",
    "trace:0.55,0.40,0.05@fp8": "fp8 weights, mix 2.5",
    "fixed@kv_fp8": "fp8 KV",
    "fixed@fp8@kv_fp8": "fp8 weights + KV",
}
LATENCIES = (
    ("time to first token (ms)", "ttft"),
    ("time per output token (ms)", "tpot"),
    ("end-to-end latency (ms)", "e2el"),
)


def fp8(plt, args) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    titles = {"fp8_c1": "1 request", "fp8_c128": "128 requests"}
    for ax, name in zip(axes, titles, strict=True):
        results = json.loads((RESULTS / "fp8_h200" / f"{name}.json").read_text())["results"]
        values = [r["decode_output_tokens_per_s"] for r in results]
        bars = ax.bar(range(len(values)), values, color="#4c72b0")
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        labels = [FP8_LABELS[r["arm"]] for r in results]
        ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{titles[name]}: decode tok/s", fontsize=10)
    fig.suptitle("fp8 on one H200, Ouro-1.4B shape, 1,024 in / 128 out", fontsize=10)
    return save(fig, args.out or ASSETS / "fp8-h200.png", dpi=120)


def alpha(arm: dict) -> float:
    return arm["forced_alpha"]


def speculative(plt, args) -> Path:
    folder = RESULTS / "speculative_h200"
    grid = json.loads((folder / "c1_grid_fused.json").read_text())["arms"]
    sweep = json.loads((folder / "concurrency_sweep_k3.json").read_text())["arms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = sorted({(a["num_speculative_tokens"], a["speculative_draft_loops"]) for a in grid})
    for k, d in (c for c in configs if c[0]):
        arms = [
            a for a in grid if (a["num_speculative_tokens"], a["speculative_draft_loops"]) == (k, d)
        ]
        arms.sort(key=lambda a: a["forced_alpha"])
        style = "-" if d == 1 else "--"
        xs, ys = [a["forced_alpha"] for a in arms], [a["speedup"] for a in arms]
        left.plot(xs, ys, marker="o", linestyle=style, label=f"K={k}, D={d}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.axhline(1.6, color="red", linewidth=0.8, linestyle=":", label="target 1.6x")
    left.set_xlabel("forced per-draft acceptance alpha")
    left.set_ylabel("decode tok/s / plain decode tok/s")
    plain_c1 = next(a for a in grid if not a["num_speculative_tokens"])
    left.set_title(
        f"1 request, Ouro-1.4B shape, fixed depth "
        f"(plain {plain_c1['decode_output_tokens_per_s']} tok/s)"
    )
    left.legend(fontsize=8)
    spec = sorted((a for a in sweep if a["num_speculative_tokens"]), key=lambda a: a["concurrency"])
    plain = {a["concurrency"]: a for a in sweep if not a["num_speculative_tokens"]}
    xs = [a["concurrency"] for a in spec]
    right.plot(xs, [a["speedup"] for a in spec], marker="o", label="decode")
    e2e = [a["output_tokens_per_s"] / plain[a["concurrency"]]["output_tokens_per_s"] for a in spec]
    right.plot(xs, e2e, marker="s", label="end to end")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.axvline(16, color="red", linewidth=0.8, linestyle=":", label="default disable limit")
    right.set_xscale("log", base=2)
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlabel("concurrent requests (speculation never paused)")
    right.set_ylabel("speculative / plain")
    right.set_title("K=3, D=1, alpha 0.9")
    right.legend(fontsize=8)
    return save(fig, args.out or ASSETS / "speculative-h200.png")


def serving_sweeps(plt, args) -> Path:
    if not args.sweep or args.out is None:
        raise SystemExit("serving-sweeps needs --sweep LABEL DIR (repeatable) and --out")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, (label, directory) in enumerate(args.sweep):
        results = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]
        results.sort(key=lambda r: float(r["request_rate"]))  # float("inf") sorts last
        rates = [str(r["request_rate"]) for r in results]
        xs, color = range(len(rates)), f"C{index}"
        loops = results[0].get("mean_loops_per_token")
        name = f"{label} ({loops:.2f} loops/token)" if loops else label
        for ax, (title, key) in zip(axes, LATENCIES, strict=False):
            ax.plot(xs, [r[f"median_{key}_ms"] for r in results], color=color, marker="o")
            ax.plot(xs, [r[f"p99_{key}_ms"] for r in results], color=color, linestyle="--")
            ax.set_title(title)
        throughput = [r["output_throughput"] for r in results]
        axes[3].plot(xs, throughput, color=color, marker="o", label=name)
        axes[3].set_title("output throughput (tok/s)")
        for ax in axes:
            ax.set_xticks(list(xs), rates)
            ax.set_xlabel("request rate (req/s)")
    axes[3].legend(fontsize=8)
    axes[0].text(0.02, 0.95, "solid p50, dashed p99", transform=axes[0].transAxes, fontsize=8)
    fig.suptitle(args.title)
    return save(fig, args.out, dpi=100)


def save(fig, out: Path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    return out


FIGURES = {"fp8": fp8, "speculative": speculative, "serving-sweeps": serving_sweeps}


def main(argv=None) -> int:
    p = parser(__doc__, out=False)
    p.add_argument("figure", choices=sorted(FIGURES))
    p.add_argument("--out", type=Path, default=None, help="the image (default: docs/assets/...)")
    p.add_argument("--sweep", nargs=2, action="append", metavar=("LABEL", "DIR"))
    p.add_argument("--title", default="rlt serve: request-rate sweep")
    args = p.parse_args(argv)
    plt = pyplot()
    if plt is None:
        raise SystemExit("needs matplotlib: uv run --with matplotlib python benchmarks/plots.py")
    print(f"wrote {FIGURES[args.figure](plt, args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
