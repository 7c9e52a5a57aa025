"""Extract the per-instance curves that drive the fleet simulation from measured H200 files.

    python benchmarks/fleet_curves.py [--out benchmarks/data/fleet_curves_h200.json]

Every number in the output is read from a result file already in the repository (or, for the
two geometry / bandwidth constants, from docs/results.md, which states them); each entry names
its source. Nothing here is fitted: the two constants the simulator fits to the served sweep
(`calibration`) are written by `python benchmarks/fleet_sim.py calibrate --write`, which keeps
this file's measured sections as they are.
"""

from __future__ import annotations

import json

from harness import ROOT, parser, write_json

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = ROOT / "benchmarks" / "data" / "fleet_curves_h200.json"

TABLE_DIR = "benchmarks/results/h200_table_f230e5a"
SWEEP_DIR = "benchmarks/results/h200_serving_sweep"
PREFILL_FILE = "benchmarks/results/batch_invariance_h200.json"
PREFILL_STEP_FILE = "benchmarks/results/prefill_host_cost.json"
SERVED_FILE = "benchmarks/results/engine_process_h200/served/served_vs_offline.json"
TRANSFER_FILE = "benchmarks/results/pd_transfer_h200.json"
PD_SERVING_FILE = "benchmarks/results/pd_serving_h200.json"


def _load(relative: str) -> dict:
    return json.loads((ROOT / relative).read_text())


def decode_ticks() -> dict:
    """Wall time of one decode tick (one loop for every running row) against the row count.

    tick ms = rows / (decode output tok/s x loops per token): the decode phase's wall clock
    (steps without prefill, host gaps included) of the fixed-depth arm, 1,024-token prompts and
    128 outputs, so the rows' mean context is 1,024 + 64 = 1,088 tokens.
    """
    rows, tick_ms, gpu_ms, mix_tick_ms = [], [], [], []
    for name in ("c1", "c32", "c128"):
        run = _load(f"{TABLE_DIR}/{name}.json")
        arms = {result["arm"]: result for result in run["results"]}
        fixed, mix = arms["fixed"], arms["trace:0.55,0.40,0.05"]
        batch = run["setup"]["max_num_seqs"]
        rows.append(batch)
        tick_ms.append(
            round(
                1000.0
                * batch
                / (fixed["decode_output_tokens_per_s"] * fixed["mean_loops_per_decoded_token"]),
                4,
            )
        )
        mix_tick_ms.append(
            round(
                1000.0
                * batch
                / (mix["decode_output_tokens_per_s"] * mix["mean_loops_per_decoded_token"]),
                4,
            )
        )
        gpu_ms.append(fixed["profile"]["gpu_ms_per_loop"])
        prompt_len, output_len = run["setup"]["prompt_len"], run["setup"]["output_len"]
    return {
        "rows": rows,
        "tick_ms": tick_ms,
        "mix_tick_ms": mix_tick_ms,
        "gpu_ms_per_loop": gpu_ms,
        "mean_context_tokens": prompt_len + output_len // 2,
        "source": f"{TABLE_DIR}/c{{1,32,128}}.json: rows / (decode_output_tokens_per_s x "
        "mean_loops_per_decoded_token) of the `fixed` arm (mix_tick_ms: the 2.5-loop trace arm); "
        "gpu_ms_per_loop from the same arm's profile",
    }


def kv_read() -> dict:
    """What a tick's attention reads per context token, to scale ticks to other contexts."""
    return {
        "bytes_per_context_token_per_loop": 24 * 2 * 16 * 128 * 2,
        "hbm_gb_per_s": 4200.0,
        "source": "docs/results.md, 'The whole table in one run': 192 KiB per context token per "
        "row per loop (24 layers, K and V, 16 heads of 128, bf16), roofline at 4.2 TB/s",
    }


def prefill() -> dict:
    """Full-depth prefill throughput against prompts in flight (1,024-token prompts)."""
    run = _load(PREFILL_FILE)
    points = [r for r in run["results"] if not r["batch_invariant"] and r["dtype"] == "bfloat16"]
    step = _load(PREFILL_STEP_FILE)
    return {
        "prompts": [r["batch"] for r in points],
        "prompt_tokens": run["prompt_len"],
        "tokens_per_s": [round(r["prefill_tokens_per_s"], 1) for r in points],
        "source": f"{PREFILL_FILE}: prefill_tokens_per_s, batch_invariant false, bf16",
        "step_check": {
            "tokens": step["chunks"] * step["chunk_len"],
            "gpu_ms": step["arms"]["pdl"]["gpu_ms"],
            "source": f"{PREFILL_STEP_FILE}: arms.pdl.gpu_ms (one step of two 1,024-token chunks)",
        },
        "gemm_loop_ms_batch1": 0.971,
        "gemm_loop_source": "docs/results.md, 'The whole table in one run': GEMM-only loop "
        "(cuBLAS graph) at c1, 0.971 ms: the floor of one loop however few tokens it computes",
    }


def kv_capacity() -> dict:
    log = _load(SERVED_FILE)["startup_log"]
    line = next(entry for entry in log if "KV pool" in entry)
    tokens = int(line.split("= ")[1].split(" tokens")[0])
    return {
        "tokens": tokens,
        "bytes_per_token": 786432,
        "source": f"{SERVED_FILE}: startup_log, `rlt serve` on the H200 with its defaults "
        "(LAST_EXITED, bf16; 768 KiB per token: 4 planes)",
    }


def served_sweep() -> dict:
    """`rlt bench serve` against `rlt serve`: the single-instance curves the fleet is checked on."""
    arms = {}
    for arm, directory in (("fixed", "sweep-fixed"), ("mix", "sweep-mix")):
        points = []
        for path in sorted((ROOT / SWEEP_DIR / directory).glob("*.json")):
            run = json.loads(path.read_text())
            rate = float(run["request_rate"])  # "inf" is stored as a string
            points.append(
                {
                    "rate": None if rate == float("inf") else rate,
                    "request_throughput": round(run["request_throughput"], 3),
                    "output_throughput": round(run["output_throughput"], 1),
                    "ttft_p50_ms": round(run["p50_ttft_ms"], 1),
                    "ttft_p99_ms": round(run["p99_ttft_ms"], 1),
                    "tpot_p50_ms": round(run["p50_tpot_ms"], 2),
                    "tpot_p99_ms": round(run["p99_tpot_ms"], 2),
                    "mean_loops_per_token": round(run["mean_loops_per_token"], 3),
                    "num_prompts": run["num_prompts"],
                    "file": str(path.relative_to(ROOT)),
                }
            )
        points.sort(key=lambda p: float("inf") if p["rate"] is None else p["rate"])
        arms[arm] = points
    first = json.loads(next((ROOT / SWEEP_DIR / "sweep-fixed").glob("*.json")).read_text())
    return {
        "prompt_tokens": first["random_input_len"],
        "output_tokens": first["random_output_len"],
        "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "prefill_chunk": 1024},
        "arms": arms,
        "source": f"{SWEEP_DIR}/sweep-{{fixed,mix}}/*.json (docs/results.md, 'Serving under "
        "load (one H200)'); engine flags from that section",
    }


def pd() -> dict:
    transfer = _load(TRANSFER_FILE)
    contiguous = [r for r in transfer["results"] if r["tables"] == "contiguous"]
    serving = _load(PD_SERVING_FILE)
    rates = {}
    for config in ("pd", "replicas"):
        for rate, point in serving["configs"][config]["rates"].items():
            rates.setdefault(rate, {})[config] = {
                "ttft_p50_ms": round(point["p50_ttft_ms"], 1),
                "ttft_p99_ms": round(point["p99_ttft_ms"], 1),
                "tpot_p50_ms": round(point["p50_tpot_ms"], 2),
                "request_throughput": round(point["request_throughput"], 2),
            }
    return {
        "transfer": {
            "tokens": [r["tokens"] for r in contiguous],
            "ms": [round(1000.0 * r["median_wall_s"], 2) for r in contiguous],
            "source": f"{TRANSFER_FILE}: contiguous tables, median_wall_s (P and D processes on "
            "one H200, NIXL over UCX; not measured between two GPUs or two hosts)",
        },
        "serving": {
            "prompt_tokens": serving["config"]["input_len"],
            "output_tokens": serving["config"]["output_len"],
            "rates": rates,
            "source": f"{PD_SERVING_FILE}: 1P1D against 2 replicas on one H200",
        },
    }


def build() -> dict:
    return {
        "about": "Per-instance curves of rlt on one H200 (random Ouro-1.4B-shaped checkpoint, "
        "bf16, LAST_EXITED), read from measured result files by benchmarks/fleet_curves.py; "
        "input of benchmarks/fleet_sim.py",
        "decode_ticks": decode_ticks(),
        "kv_read": kv_read(),
        "prefill": prefill(),
        "kv_capacity": kv_capacity(),
        "served_sweep": served_sweep(),
        "pd": pd(),
    }


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    out, curves = args.out or DEFAULT_OUT, build()
    if out.exists():  # keep the fitted constants written by `fleet_sim.py calibrate`
        curves |= {k: v for k, v in json.loads(out.read_text()).items() if k == "calibration"}
    write_json(out, curves)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
