"""Draw a request-rate sweep: latency percentiles and throughput against the request rate.

matplotlib is an optional extra (`pip install 'rlt[bench]'`); it is imported only here, when a
plot is asked for. Rates are placed evenly along the x axis and labelled (so `inf` has a
place); each panel shows p50 (solid) and p99 (dashed) where that applies.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from rlt_contracts import ConfigurationError


def require_matplotlib():
    """The matplotlib module, or a ConfigurationError saying how to install it."""
    try:
        return importlib.import_module("matplotlib")  # optional extra `rlt[bench]`
    except ImportError:
        raise ConfigurationError(
            "plot",
            "needs matplotlib, which is not installed: pip install 'rlt[bench]' "
            "(in this repository: uv run --with matplotlib rlt bench serve ...)",
        ) from None


def _pyplot():
    require_matplotlib().use("Agg")  # files only, no display
    return importlib.import_module("matplotlib.pyplot")


def _label(rate) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


PANELS = (
    ("Time to first token (ms)", ("ttft",)),
    ("Per-token latency (ms)", ("tpot", "itl")),
    ("End-to-end latency (ms)", ("e2el",)),
)


def plot_sweep(results: list[dict], path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG/SVG/PDF (by the file suffix) of `results` (one result per request rate)."""
    if not results:
        raise ConfigurationError("plot", "no results to plot")
    plt = _pyplot()
    labels = [_label(r["request_rate"]) for r in results]
    xs = list(range(len(results)))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (ylabel, metrics) in zip(axes, PANELS, strict=False):
        for metric in metrics:
            for q, style in (("median", "-"), ("p99", "--")):
                ys = [r.get(f"{q}_{metric}_ms") for r in results]
                ys = [float("nan") if y is None else y for y in ys]
                name = "p50" if q == "median" else q
                ax.plot(xs, ys, style, marker="o", label=f"{metric.upper()} {name}")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small")
    ax = axes[3]
    ax.plot(xs, [r["output_throughput"] for r in results], "-", marker="o", label="output tok/s")
    ax.set_ylabel("Output throughput (tok/s)")
    twin = ax.twinx()
    twin.plot(
        xs,
        [r["request_throughput"] for r in results],
        ":",
        marker="s",
        color="tab:red",
        label="completed req/s",
    )
    twin.set_ylabel("Request throughput (req/s)")
    ax.legend(loc="upper left", fontsize="small")
    twin.legend(loc="lower right", fontsize="small")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("Request rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "rlt bench serve: request-rate sweep")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
