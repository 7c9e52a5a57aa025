"""Overlay several `rlt bench serve` request-rate sweeps (e.g. fixed depth vs adaptive exit).

    uv run --with matplotlib python benchmarks/plot_serving_sweeps.py \\
        --sweep "threshold 1.0" DIR1 --sweep "threshold 0.5" DIR2 --out docs/assets/sweep.png

Each DIR holds the result JSONs one sweep saved (`--sweep-request-rates ... --save-result
--result-dir DIR`). Panels: TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed) and output
throughput against the request rate; the legend gives each sweep's mean loops per token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (
    ("time to first token (ms)", "ttft"),
    ("time per output token (ms)", "tpot"),
    ("end-to-end latency (ms)", "e2el"),
)


def load(directory: Path) -> list[dict]:
    """The sweep's results ordered by request rate (`inf` last)."""
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    return sorted(
        results, key=lambda r: float("inf") if r["request_rate"] == "inf" else r["request_rate"]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", nargs=2, action="append", metavar=("LABEL", "DIR"), required=True
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="rlt serve: request-rate sweep")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, (label, directory) in enumerate(args.sweep):
        results = load(Path(directory))
        rates = [str(r["request_rate"]) for r in results]
        xs = range(len(rates))
        color = f"C{index}"
        loops = results[0].get("mean_loops_per_token")
        name = f"{label} ({loops:.2f} loops/token)" if loops else label
        for ax, (title, key) in zip(axes, PANELS, strict=False):
            ax.plot(xs, [r[f"median_{key}_ms"] for r in results], color=color, marker="o")
            ax.plot(xs, [r[f"p99_{key}_ms"] for r in results], color=color, linestyle="--")
            ax.set_title(title)
        axes[3].plot(
            xs, [r["output_throughput"] for r in results], color=color, marker="o", label=name
        )
        axes[3].set_title("output throughput (tok/s)")
        for ax in axes:
            ax.set_xticks(list(xs), rates)
            ax.set_xlabel("request rate (req/s)")
    axes[3].legend(fontsize=8)
    axes[0].text(
        0.02, 0.95, "solid p50, dashed p99", transform=axes[0].transAxes, fontsize=8, va="top"
    )
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
