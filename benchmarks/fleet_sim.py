"""Simulate an rlt fleet of 100 to 1,000 GPUs from curves measured on one H200.

    python benchmarks/fleet_sim.py calibrate [--write]   # fit the two served-overhead constants
    python benchmarks/fleet_sim.py validate              # one instance against the served sweep
    python benchmarks/fleet_sim.py sweep --gpus 100      # policies x traces x rates -> goodput
    python benchmarks/fleet_sim.py scale --gpus 1000     # one rate per policy at 1,000 GPUs
    python benchmarks/fleet_sim.py plot                  # the 100-GPU sweep's goodput as SVG

Inputs: benchmarks/data/fleet_curves_h200.json (written by benchmarks/fleet_curves.py from
measured files). Outputs: benchmarks/results/fleet_sim/*.json and docs/assets/fleet-sim.svg.
Goodput of a policy on a trace = the largest offered request rate (per GPU, on the rate grid,
refined by bisection) at which the measured requests' TTFT p99 <= 1 s and TPOT p99 <= 50 ms
with none left unfinished. Method and limits: docs/scale.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from fleetsim.curves import DEFAULT_CURVES, Calibration, InstanceCosts, load_curves
from fleetsim.fleet import Fleet, FleetConfig
from fleetsim.metrics import summarize
from fleetsim.traces import ChatTrace, RandomTrace, Trace
from harness import ROOT, parser, record, write_json

RESULTS = ROOT / "benchmarks" / "results" / "fleet_sim"
PLOT = ROOT / "docs" / "assets" / "fleet-sim.svg"
POLICIES = (
    ("round_robin", (1, 1)),
    ("least_loaded", (1, 1)),
    ("prefix_affinity", (1, 1)),
    ("pd", (1, 3)),
    ("pd", (1, 1)),
    ("pd", (3, 1)),
)
RATE_GRID = (4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0, 32.0)  # requests/s per GPU
VALIDATION_REQUESTS = 150  # as in the measured sweep


# -- a single instance against the measured served sweep ----------------------------------------
def served_sweep_run(curves: dict, costs: InstanceCosts, rate: float | None, mean_loops: float):
    """The served sweep's workload (512 in / 128 out, Poisson or all at once) on one instance."""
    sweep = curves["served_sweep"]
    shape = (sweep["prompt_tokens"], sweep["output_tokens"])
    offered = rate or 1e6
    trace = RandomTrace(
        offered, math.inf, block_tokens=128, seed=0, fixed=shape, count=VALIDATION_REQUESTS
    )
    fleet = Fleet(FleetConfig(1, "round_robin", mean_loops=mean_loops), costs)
    requests = fleet.run(trace)
    summary = summarize(requests, warmup_s=0.0, horizon_s=trace.horizon_s)
    first = min(r.arrival_s for r in requests)
    summary["request_throughput"] = len(requests) / (max(r.finish_s for r in requests) - first)
    return summary


def _fit_error(curves: dict, costs: InstanceCosts) -> float:
    """Squared log error of TPOT p50 / p99 at every rate and saturated throughput (fixed arm)."""
    error = 0.0
    for point in curves["served_sweep"]["arms"]["fixed"]:
        sim = served_sweep_run(curves, costs, point["rate"], 4.0)
        error += math.log(sim["tpot_p50_ms"] / point["tpot_p50_ms"]) ** 2
        error += math.log(sim["tpot_p99_ms"] / point["tpot_p99_ms"]) ** 2
        if point["rate"] is None:
            error += math.log(sim["request_throughput"] / point["request_throughput"]) ** 2
    return error


def calibrate(curves: dict) -> Calibration:
    """Fit `step_overhead_ms` (grid, 0.5 ms) and `front_end_ms` (median TTFT p50 residual)."""
    handoff = _handoff_ms(curves)
    best = min(
        (_fit_error(curves, InstanceCosts(curves, Calibration(step / 2, 0.0, handoff))), step / 2)
        for step in range(0, 41)
    )[1]
    costs = InstanceCosts(curves, Calibration(best, 0.0, handoff))
    residuals = sorted(
        point["ttft_p50_ms"] - served_sweep_run(curves, costs, point["rate"], 4.0)["ttft_p50_ms"]
        for point in curves["served_sweep"]["arms"]["fixed"]
        if point["rate"] is not None and point["rate"] <= 16
    )
    return Calibration(best, round(residuals[len(residuals) // 2], 1), handoff)


def _handoff_ms(curves: dict) -> float:
    """PD TTFT p50 - replicas' TTFT p50 - the prompt's copy, at the lowest measured rate."""
    serving = curves["pd"]["serving"]
    low = serving["rates"][min(serving["rates"], key=float)]
    costs = InstanceCosts(curves, Calibration(0.0, 0.0, 0.0))
    copy = costs.transfer_ms(serving["prompt_tokens"])
    return round(low["pd"]["ttft_p50_ms"] - low["replicas"]["ttft_p50_ms"] - copy, 1)


def validate(curves: dict, costs: InstanceCosts) -> dict:
    rows = {}
    for arm, loops in (("fixed", 4.0), ("mix", None)):
        points = curves["served_sweep"]["arms"][arm]
        mean_loops = loops or points[0]["mean_loops_per_token"]
        rows[arm] = []
        for point in points:
            sim = served_sweep_run(curves, costs, point["rate"], mean_loops)
            rows[arm].append(
                {
                    "rate": point["rate"],
                    **{
                        f"{key}_{side}": round(value, 2)
                        for key in ("ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms")
                        for side, value in (("measured", point[key]), ("simulated", sim[key]))
                    },
                    "request_throughput_measured": point["request_throughput"],
                    "request_throughput_simulated": round(sim["request_throughput"], 2),
                }
            )
    return rows


# -- the fleet ------------------------------------------------------------------------------------
def make_trace(kind: str, rate: float, horizon_s: float, block_tokens: int, seed: int) -> Trace:
    if kind == "chat":
        return ChatTrace(rate, horizon_s, block_tokens=block_tokens, seed=seed)
    return RandomTrace(rate, horizon_s, block_tokens=block_tokens, seed=seed)


def simulate(
    costs: InstanceCosts,
    config: FleetConfig,
    trace_kind: str,
    rate_per_gpu: float,
    *,
    horizon_s: float,
    warmup_s: float,
    seed: int,
) -> dict:
    started = time.perf_counter()
    fleet = Fleet(config, costs)
    trace = make_trace(
        trace_kind, rate_per_gpu * config.gpus, horizon_s, config.limits.block_tokens, seed
    )
    requests = fleet.run(trace)
    summary = summarize(requests, warmup_s=warmup_s, horizon_s=horizon_s)
    busy = [i.stats.busy_ms for i in fleet.instances]
    summary.update(
        policy=config.label,
        trace=trace_kind,
        gpus=config.gpus,
        offered_rate_per_gpu=rate_per_gpu,
        requests=len(requests),
        events=fleet.events_processed,
        busiest_instance_busy_s=max(busy) / 1000.0,
        mean_instance_busy_s=sum(busy) / len(busy) / 1000.0,
        runtime_s=round(time.perf_counter() - started, 2),
    )
    return summary


def goodput(
    costs: InstanceCosts, config: FleetConfig, trace_kind: str, *, bisect_steps: int, **kwargs
) -> tuple[float, list[dict]]:
    """Largest offered rate per GPU meeting the SLO: the grid, then bisection above the last
    pass."""
    runs, passed, failed = [], 0.0, None
    for rate in RATE_GRID:
        run = simulate(costs, config, trace_kind, rate, **kwargs)
        runs.append(run)
        print(_line(run), flush=True)
        if not run["slo_met"]:
            failed = rate
            break
        passed = rate
    if failed is not None:
        low, high = passed, failed
        for _ in range(bisect_steps):
            middle = (low + high) / 2
            run = simulate(costs, config, trace_kind, middle, **kwargs)
            runs.append(run)
            print(_line(run), flush=True)
            low, high = (middle, high) if run["slo_met"] else (low, middle)
        passed = low
    return passed, runs


def _line(run: dict) -> str:
    return (
        f"{run['gpus']:>5} GPUs {run['policy']:<16} {run['trace']:<6} "
        f"{run['offered_rate_per_gpu']:>5.1f} req/s/GPU: TTFT p50/p99 {run['ttft_p50_ms']:>7.0f} / "
        f"{run['ttft_p99_ms']:>7.0f} ms, TPOT p50/p99 {run['tpot_p50_ms']:>5.1f} / "
        f"{run['tpot_p99_ms']:>5.1f} ms, hit {run['prefix_hit_rate']:.2f}, "
        f"SLO {'met' if run['slo_met'] else 'missed'} ({run['runtime_s']:.1f} s)"
    )


def fleet_configs(gpus: int, mean_loops: float) -> list[FleetConfig]:
    return [
        FleetConfig(gpus, policy, pd_ratio=ratio, mean_loops=mean_loops)
        for policy, ratio in POLICIES
    ]


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("command", choices=("calibrate", "validate", "sweep", "scale", "plot"))
    p.add_argument("--curves", type=Path, default=DEFAULT_CURVES)
    p.add_argument("--write", action="store_true", help="calibrate: store the fit")
    p.add_argument("--gpus", type=int, default=100)
    p.add_argument("--traces", default="chat,random")
    p.add_argument("--horizon-s", type=float, default=45.0)
    p.add_argument("--warmup-s", type=float, default=15.0)
    p.add_argument("--bisect-steps", type=int, default=2)
    p.add_argument("--mean-loops", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", default="", help="scale: rate per GPU per policy, a=b,...")
    args = p.parse_args(argv)
    curves = load_curves(args.curves)

    if args.command == "calibrate":
        fitted = calibrate(curves)
        print(fitted)
        if args.write:
            curves["calibration"] = {
                **fitted.__dict__,
                "method": "step_overhead_ms: grid (0.5 ms) minimizing the squared log error of "
                "TPOT p50/p99 at every rate and the saturated request throughput of the served "
                "sweep's fixed arm; front_end_ms: median over rates 4-16 of measured - simulated "
                "TTFT p50; handoff_ms: PD TTFT p50 - replicas TTFT p50 - the 512-token copy at "
                "4 req/s (benchmarks/fleet_sim.py calibrate)",
            }
            write_json(args.curves, curves)
        return

    costs = InstanceCosts(curves)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.command == "validate":
        rows = validate(curves, costs)
        for arm, points in rows.items():
            for point in points:
                print(arm, point)
        out = args.out or RESULTS / "validation.json"
        write_json(out, {"calibration": curves["calibration"], "arms": rows})
        return

    if args.command == "plot":
        from fleetsim.plot import plot

        plot(args.out or RESULTS / f"sweep_{args.gpus}gpus.json", PLOT)
        return

    kwargs = {"horizon_s": args.horizon_s, "warmup_s": args.warmup_s, "seed": args.seed}
    traces = args.traces.split(",")
    started = time.perf_counter()
    results = record("fleet_sim", args, gpus=args.gpus, calibration=curves["calibration"])
    configs = fleet_configs(args.gpus, args.mean_loops)
    if args.command == "sweep":
        results["rate_grid_per_gpu"] = RATE_GRID
        results["goodput"], results["runs"] = [], []
        for trace_kind in traces:
            for config in configs:
                best, runs = goodput(
                    costs, config, trace_kind, bisect_steps=args.bisect_steps, **kwargs
                )
                results["runs"] += runs
                passing = [r for r in runs if r["offered_rate_per_gpu"] == best]
                results["goodput"].append(
                    {
                        "policy": config.label,
                        "trace": trace_kind,
                        "goodput_req_s_per_gpu": best,
                        "goodput_req_s": best * args.gpus,
                        "at_goodput": passing[0] if passing else None,
                    }
                )
        name = f"sweep_{args.gpus}gpus.json"
    else:  # scale: one rate per policy
        rates = dict(item.split("=") for item in args.rates.split(",") if item)
        results["runs"] = []
        for trace_kind in traces:
            for config in configs:
                rate = float(rates.get(config.label.replace(" ", ""), 16.0))
                run = simulate(costs, replace(config), trace_kind, rate, **kwargs)
                print(_line(run), flush=True)
                results["runs"].append(run)
        name = f"scale_{args.gpus}gpus.json"
    results["wall_s"] = round(time.perf_counter() - started, 1)
    out = args.out or RESULTS / name
    write_json(out, results)
    print(f"wrote {out} in {results['wall_s']} s")


if __name__ == "__main__":
    main()
