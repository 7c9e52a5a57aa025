"""What one instance's step costs, from the measured curves in benchmarks/data/.

A step of an rlt engine runs some prompt chunks (at full depth) and some decode ticks (one loop
for every decoding row). Its wall time here is

    step_overhead_ms + prefill_ms(prompt tokens) + ticks x tick_ms(rows, their context)

with `tick_ms` interpolated between the measured row counts (1, 32, 128) after removing the
attention's share, which is rescaled to the rows' actual context (192 KiB read per context
token per loop at the measured 4.2 TB/s roofline), and `prefill_ms` the saturated measured
prefill rate, floored at the weight reads of four loops. `step_overhead_ms` (host time per step
of the served engine that the offline curves do not show) and `front_end_ms` (HTTP, tokenizing,
streaming the first token) are the two constants fitted to the served sweep.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CURVES = Path(__file__).resolve().parents[1] / "data" / "fleet_curves_h200.json"
PREFILL_LOOPS = 4  # prompts always run every loop (the exit gate applies to decoded tokens)


def interpolate(x: float, xs: list[float], ys: list[float], *, extrapolate: bool = False) -> float:
    """Piecewise-linear y(x); clamped outside the points unless `extrapolate` (last slope)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if not extrapolate:
            return ys[-1]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Calibration:
    """Constants fitted to (or derived from) the served measurements, not read off one file."""

    step_overhead_ms: float  # per engine step, fitted to the served sweep
    front_end_ms: float  # per request before it reaches the engine, fitted to the served sweep
    handoff_ms: float  # PD: per handoff besides the KV copy (PD TTFT - replica TTFT - copy)


class InstanceCosts:
    """Wall time of one instance's steps and of a PD handoff, in milliseconds."""

    def __init__(self, curves: dict, calibration: Calibration | None = None) -> None:
        ticks = curves["decode_ticks"]
        kv = curves["kv_read"]
        # ms per context token per tick: bytes / (GB/s * 1e9) * 1e3
        self.kv_ms_per_token = kv["bytes_per_context_token_per_loop"] / (kv["hbm_gb_per_s"] * 1e6)
        mean_context = ticks["mean_context_tokens"]
        self._rows = [float(r) for r in ticks["rows"]]
        self._base_ms = [
            tick - rows * mean_context * self.kv_ms_per_token
            for rows, tick in zip(ticks["rows"], ticks["tick_ms"], strict=True)
        ]
        prefill = curves["prefill"]
        self.prefill_tokens_per_ms = max(prefill["tokens_per_s"]) / 1000.0
        self.prefill_floor_ms = PREFILL_LOOPS * prefill["gemm_loop_ms_batch1"]
        transfer = curves["pd"]["transfer"]
        self._transfer_tokens = [float(t) for t in transfer["tokens"]]
        self._transfer_ms = transfer["ms"]
        if calibration is None:
            fitted = curves["calibration"]
            calibration = Calibration(
                fitted["step_overhead_ms"], fitted["front_end_ms"], fitted["handoff_ms"]
            )
        self.calibration = calibration

    def tick_ms(self, rows: int, context_tokens: float) -> float:
        """One loop for `rows` decoding rows whose contexts sum to `context_tokens`."""
        if rows <= 0:
            return 0.0
        return interpolate(rows, self._rows, self._base_ms) + context_tokens * self.kv_ms_per_token

    def prefill_ms(self, tokens: int) -> float:
        """`tokens` prompt positions at full depth in one step (0 when there are none)."""
        if tokens <= 0:
            return 0.0
        return max(self.prefill_floor_ms, tokens / self.prefill_tokens_per_ms)

    def transfer_ms(self, tokens: int) -> float:
        """Copy of `tokens` positions' KV (every plane) from P to D, as measured on one GPU."""
        if tokens <= 0:
            return 0.0
        scaled = interpolate(tokens, self._transfer_tokens, self._transfer_ms, extrapolate=True)
        if tokens < self._transfer_tokens[0]:  # below the first point: proportional
            scaled = self._transfer_ms[0] * tokens / self._transfer_tokens[0]
        return scaled


def load_curves(path: Path = DEFAULT_CURVES) -> dict:
    return json.loads(Path(path).read_text())
