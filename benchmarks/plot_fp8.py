"""Plot fp8 against bf16 decode throughput on the H200 (docs/assets/fp8-h200.png).

    uv run --with matplotlib python benchmarks/plot_fp8.py
reads benchmarks/results/fp8_h200/fp8_c1.json and fp8_c128.json (tools/h200_run.sh fp8 c).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fp8_h200"
LABELS = {
    "fixed": "bf16",
    "fixed@fp8": "fp8 weights",
    "trace:0.55,0.40,0.05": "bf16, mix 2.5",
    "trace:0.55,0.40,0.05@fp8": "fp8 weights, mix 2.5",
    "fixed@kv_fp8": "fp8 KV",
    "fixed@fp8@kv_fp8": "fp8 weights + KV",
}


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, name, title in (
        (axes[0], "fp8_c1.json", "1 request"),
        (axes[1], "fp8_c128.json", "128 requests"),
    ):
        results = json.loads((RESULTS / name).read_text())["results"]
        labels = [LABELS[r["arm"]] for r in results]
        values = [r["decode_output_tokens_per_s"] for r in results]
        bars = ax.bar(range(len(values)), values, color="#4c72b0")
        for bar, value in zip(bars, values, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                value,
                f"{value:,.0f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{title}: decode tok/s", fontsize=10)
    fig.suptitle("fp8 on one H200, Ouro-1.4B shape, 1,024 in / 128 out", fontsize=10)
    fig.tight_layout()
    out = ROOT / "docs" / "assets" / "fp8-h200.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
