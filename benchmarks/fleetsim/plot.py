"""The sweep's goodput per policy as a hand-written SVG bar chart (no plotting dependency)."""

from __future__ import annotations

import json
from pathlib import Path

_COLORS = {"chat": "#3b6ea8", "random": "#d08c2f"}
_WIDTH, _HEIGHT = 760, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 20, 40, 70


def plot(sweep_json: Path, out: Path) -> None:
    sweep = json.loads(sweep_json.read_text())
    rows = sweep["goodput"]
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    traces = list(dict.fromkeys(row["trace"] for row in rows))
    value = {(row["policy"], row["trace"]): row["goodput_req_s_per_gpu"] for row in rows}
    hits = {
        (row["policy"], row["trace"]): (row["at_goodput"] or {}).get("prefix_hit_rate", 0.0)
        for row in rows
    }
    top = max(value.values()) * 1.15 or 1.0
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    group_w = plot_w / len(policies)
    bar_w = group_w * 0.8 / len(traces)
    y = lambda v: _TOP + plot_h * (1 - v / top)  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
        f'<text x="{_WIDTH / 2}" y="20" text-anchor="middle" font-size="14">Simulated goodput, '
        f"{sweep['gpus']} H200s (TTFT p99 &lt;= 1 s, TPOT p99 &lt;= 50 ms)</text>",
    ]
    step = 5 if top > 12 else 2
    for tick in range(0, int(top) + 1, step):
        parts.append(
            f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{_LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}</text>'
        )
    parts.append(
        f'<text x="16" y="{_TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {_TOP + plot_h / 2})">requests/s per GPU</text>'
    )
    for g, policy in enumerate(policies):
        x0 = _LEFT + g * group_w + group_w * 0.1
        for t, trace in enumerate(traces):
            v = value.get((policy, trace), 0.0)
            x = x0 + t * bar_w
            parts.append(
                f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w - 2:.1f}" '
                f'height="{_TOP + plot_h - y(v):.1f}" fill="{_COLORS.get(trace, "#888")}"/>'
                f'<text x="{x + bar_w / 2 - 1:.1f}" y="{y(v) - 4:.1f}" text-anchor="middle" '
                f'font-size="10">{v:g}</text>'
            )
            if trace == "chat":
                parts.append(
                    f'<text x="{x + bar_w / 2 - 1:.1f}" y="{_TOP + plot_h - 6:.1f}" '
                    f'text-anchor="middle" font-size="9" fill="white">'
                    f"{100 * hits[(policy, trace)]:.0f}%</text>"
                )
        parts.append(
            f'<text x="{_LEFT + (g + 0.5) * group_w:.1f}" y="{_TOP + plot_h + 18}" '
            f'text-anchor="middle">{policy}</text>'
        )
    legend_y = _HEIGHT - 22
    for t, trace in enumerate(traces):
        lx = _LEFT + t * 260
        label = (
            "multi-turn chat (in the bar: prefix hit rate)"
            if trace == "chat"
            else "random (no shared prefix)"
        )
        parts.append(
            f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" '
            f'fill="{_COLORS.get(trace, "#888")}"/>'
            f'<text x="{lx + 18}" y="{legend_y}">{label}</text>'
        )
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")
    print(f"wrote {out}")
