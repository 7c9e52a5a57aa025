"""Plot benchmark JSON files (from offline_throughput.py --json-out) as grouped bars.

uv run --with matplotlib python benchmarks/plot_results.py OUT.png LABEL=FILE.json ...
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, groups = argv[0], [arg.split("=", 1) for arg in argv[1:]]
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8))
    for ax, (label, path) in zip(axes, groups, strict=True):
        results = json.load(open(path))["results"]
        names = [r["arm"].replace("trace:0.55,0.40,0.05", "mix 2.5") for r in results]
        values = [r["output_tokens_per_s"] for r in results]
        bars = ax.bar(
            range(len(values)),
            values,
            color=["#999999" if "eager" in n else "#1f77b4" for n in names],
        )
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(values)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("output tokens/s")
    fig.suptitle(
        "rlt on one H200: random Ouro-1.4B shape, bf16, 512-token prompts (grey: no CUDA graphs)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
