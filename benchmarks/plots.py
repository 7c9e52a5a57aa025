"""The figures docs/ shows, drawn from recorded results (needs matplotlib):

    uv run --with matplotlib python benchmarks/plots.py fp8            # docs/assets/fp8-h200.png
    uv run --with matplotlib python benchmarks/plots.py speculative    # .../speculative-h200.png
    uv run --with matplotlib python benchmarks/plots.py serving-sweeps \\
        --sweep "threshold 1.0" DIR1 --sweep "threshold 0.5" DIR2 --out docs/assets/sweep.png
    uv run --with matplotlib python benchmarks/plots.py huginn --record DIR/families.json

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
huginn: docs/models.md's Huginn figure (assets/huginn-h200.png) from `tools/h200_run.sh
huginn`'s families.json: decode tok/s against requests per arm and KV layout, each adaptive
arm's ideal dotted (the base's tok/s x the layer-pass ratio), the 1-request bandwidth floor,
the authors' generate (issue 39: 4.36 tok/s at 1 request, 29.7 at 8, fixed 32 steps, H200).
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


AUTHORS_TOK_S = {1: 4.36, 8: 29.7}  # issue 39: the authors' generate, fixed 32 steps, H200


def huginn(plt, args) -> Path:
    if args.record is None:
        raise SystemExit("huginn needs --record DIR/families.json (tools/h200_run.sh huginn)")
    data = json.loads(args.record.read_text())
    summary = next(s for s in data["summaries"] if s["shape"].startswith(("huginn", "tiny-hug")))
    groups = {}  # (arm, layout and KV dtype) -> its points
    for point in summary["points"]:
        fp8 = ", fp8 KV" if "float8" in str(point["kv_cache_dtype"]) else ""
        groups.setdefault((point["arm"].split("@")[0], point["layout"] + fp8), []).append(point)
    arms = list(dict.fromkeys(arm for arm, _ in groups))
    layouts = list(dict.fromkeys(layout for _, layout in groups))
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled = set()  # the arms whose ideal has a legend entry
    for (arm, layout), points in groups.items():
        points.sort(key=lambda p: p["concurrency"])
        xs, color = [p["concurrency"] for p in points], f"C{arms.index(arm)}"
        loops = sum(p["mean_loops"] for p in points) / len(points)
        ys, index = [p["decode_tok_s"] for p in points], layouts.index(layout)
        label = f"{arm}, {layout} ({loops:.1f} steps/token)"
        ax.plot(xs, ys, color=color, marker="os^D"[index % 4], ls="-:--"[index % 3], label=label)
        if arm != arms[0]:  # an adaptive arm: its ideal, and its measured ratio over the base
            ideal = [p["decode_tok_s"] * p["ideal_over_base"] / p["over_base"] for p in points]
            label = f"ideal of {arm} (layer passes)" if arm not in labelled else None
            ax.plot(xs, ideal, color=color, linestyle=":", linewidth=1, label=label)
            labelled.add(arm)
            text = dict(fontsize=7, xytext=(4, -10), textcoords="offset points", color=color)
            for x, y, p in zip(xs, ys, points, strict=True):
                ax.annotate(f"{p['over_base']}x", (x, y), **text)
    if floor := summary.get("floor_tok_s_c1"):
        ax.scatter([1], [floor], c="k", marker="_", s=300, label="bandwidth floor, 1 request")
    label = "the authors' generate, fixed 32 steps (issue 39)"
    ax.scatter(list(AUTHORS_TOK_S), list(AUTHORS_TOK_S.values()), c="grey", marker="x", label=label)
    ticks = sorted({p["concurrency"] for p in summary["points"]} | set(AUTHORS_TOK_S))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel="concurrent requests", ylabel="decode output tokens/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    device = (data.get("bandwidth") or {}).get("device_name") or data["device"]["device_name"]
    setup = data["args"]
    ax.set_title(
        f"{summary['shape']} (random weights, {setup['dtype']}), {setup['prompt_len']} in / "
        f"{setup['output_len']} out, {device}, commit {data.get('commit')}",
        fontsize=9,
    )
    return save(fig, args.out or ASSETS / "huginn-h200.png")


def save(fig, out: Path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    return out


FIGURES = {
    "fp8": fp8,
    "speculative": speculative,
    "serving-sweeps": serving_sweeps,
    "huginn": huginn,
}


def main(argv=None) -> int:
    p = parser(__doc__, out=False)
    p.add_argument("figure", choices=sorted(FIGURES))
    p.add_argument("--out", type=Path, default=None, help="the image (default: docs/assets/...)")
    p.add_argument("--sweep", nargs=2, action="append", metavar=("LABEL", "DIR"))
    p.add_argument("--title", default="rlt serve: request-rate sweep")
    p.add_argument("--record", type=Path, help="huginn: the families.json to draw")
    args = p.parse_args(argv)
    plt = pyplot()
    if plt is None:
        raise SystemExit("needs matplotlib: uv run --with matplotlib python benchmarks/plots.py")
    print(f"wrote {FIGURES[args.figure](plt, args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
