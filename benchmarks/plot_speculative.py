"""Plot of self-speculative decoding on the H200 (docs/assets/speculative-h200.png).

Left: decode speed-up over plain decoding at one request (Ouro-1.4B shape, fixed depth) against
the forced per-draft acceptance alpha, one line per (K drafts, D draft loops), from
`benchmarks/results/speculative_h200/c1_grid_fused.json`. Right: K = 3, D = 1 at alpha 0.9
against the number of concurrent requests, decode and end to end (`concurrency_sweep_k3.json`),
with the 1.0 line; the default disable limit pauses speculation above 16 requests.

  uv run --with matplotlib python benchmarks/plot_speculative.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "speculative_h200"
OUT = ROOT / "docs" / "assets" / "speculative-h200.png"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = json.loads((RESULTS / "c1_grid_fused.json").read_text())["arms"]
    sweep = json.loads((RESULTS / "concurrency_sweep_k3.json").read_text())["arms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = sorted(
        {
            (a["num_speculative_tokens"], a["speculative_draft_loops"])
            for a in grid
            if a["num_speculative_tokens"]
        }
    )
    for k, d in configs:
        arms = sorted(
            (
                a
                for a in grid
                if (a["num_speculative_tokens"], a["speculative_draft_loops"]) == (k, d)
            ),
            key=lambda a: a["forced_alpha"],
        )
        left.plot(
            [a["forced_alpha"] for a in arms],
            [a["speedup"] for a in arms],
            marker="o",
            linestyle="-" if d == 1 else "--",
            label=f"K={k}, D={d}",
        )
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
    right.plot(
        xs,
        [a["output_tokens_per_s"] / plain[a["concurrency"]]["output_tokens_per_s"] for a in spec],
        marker="s",
        label="end to end",
    )
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.axvline(16, color="red", linewidth=0.8, linestyle=":", label="default disable limit")
    right.set_xscale("log", base=2)
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlabel("concurrent requests (speculation never paused)")
    right.set_ylabel("speculative / plain")
    right.set_title("K=3, D=1, alpha 0.9")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
