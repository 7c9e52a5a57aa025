"""GPU A/B of programmatic dependent launch (PDL) on one fused decode loop, side by side.

One recurrent step of a random Ouro-1.4B-shaped model (bf16, all 24 layers, split-KV attention
over a ~1.1K context, the engine's small-batch GEMV selection) is captured as a CUDA graph with
the Triton kernels launched with PDL and without, at several row counts; the graphs replay in
alternation (off, on, on, off, ...) and the median of each is reported, with the check that both
produce bit-identical outputs (PDL changes when a kernel starts, never what it computes). Two
more arms, with PDL: the KV store inside the split kernel ("pdl+store_in_split"), and the store
and merge inside it ("pdl+fused_decode").

  python3 benchmarks/dependent_launch_loop.py --out pdl.json    # H200, about a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import Timer, ouro_1_4b_on_cuda  # noqa: E402

# arm: (PDL, TritonPagedAttention options)
ARMS = {
    "off": (False, {}),
    "pdl": (True, {}),
    "pdl+store_in_split": (True, {"store_in_split": True}),
    "pdl+fused_decode": (True, {"fused_decode": True}),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,128", help="batch sizes (comma separated)")
    parser.add_argument("--context", type=int, default=1088)
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds per row count")
    parser.add_argument("--replays", type=int, default=10, help="graph replays per round")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def set_pdl(enabled: bool | None) -> None:
    from rlt_contracts import dependent_launch

    dependent_launch.set_enabled(enabled)  # the one switch of both kernel packages


def ptx_has_griddepcontrol() -> bool:
    """Whether a PDL launch of the one-row GEMV compiled the griddepcontrol instructions."""
    import torch
    from rlt_models import small_batch_linear as sbl

    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
    compiled = sbl._single_row_linear_kernel[(32,)](
        x,
        weight,
        out,
        64,
        256,
        256,
        out,
        BLOCK_N=2,
        BLOCK_K=256,
        USE_PDL=True,
        PREDICATED=False,
        launch_pdl=True,
    )
    torch.cuda.synchronize()
    ok = torch.allclose(out.float(), (x.float() @ weight.float().T), rtol=2e-2, atol=2e-2)
    ptx = compiled.asm["ptx"]
    return ok and "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


def time_round(replay, replays: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def bench_rows(model, paged, rows: int, args) -> dict:
    import torch
    from rlt_attention import TritonPagedAttention

    gen = torch.Generator(device="cuda").manual_seed(100 + rows)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen, device="cuda")
    hidden = model.embed(tokens)
    positions = torch.full((rows,), paged.context - 1, dtype=torch.long, device="cuda")
    batch = paged.batch(rows)
    timer = Timer("cuda", args.replays, 0)
    replays, outputs = {}, {}
    for arm, (pdl, options) in ARMS.items():
        set_pdl(pdl)
        bound = TritonPagedAttention(**options).bind(paged.kv, batch)
        replays[arm], outputs[arm] = timer.capture(
            lambda b=bound: model.recurrent_step(hidden, positions, b)
        )
    set_pdl(None)
    times = {arm: [] for arm in ARMS}
    for index in range(args.rounds + 1):
        order = list(ARMS) if index % 2 == 0 else list(ARMS)[::-1]
        for arm in order:
            ms = time_round(replays[arm], args.replays)
            if index:  # round 0 uploads the graphs and warms the clocks
                times[arm].append(ms)
    for arm in ARMS:
        replays[arm]()
    torch.cuda.synchronize()
    reference_hidden, reference_gate = outputs["off"]
    median = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "rows": rows,
        "ms_per_loop": {arm: round(value, 4) for arm, value in median.items()},
        "pdl_vs_off": round(median["pdl"] / median["off"], 4),
        "identical_to_off": {
            arm: bool(
                torch.equal(outputs[arm][0], reference_hidden)
                and torch.equal(outputs[arm][1], reference_gate)
            )
            for arm in ARMS
        },
    }


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    started = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    model, paged = ouro_1_4b_on_cuda(max(rows_list), args.context)
    model.fused_path = "triton"
    result = {
        "benchmark": "dependent_launch_loop",
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": args.context,
        "ptx_has_griddepcontrol": ptx_has_griddepcontrol(),
        "rows": [],
    }
    print(f"griddepcontrol in PTX: {result['ptx_has_griddepcontrol']}", flush=True)
    with torch.no_grad():
        for rows in rows_list:
            entry = bench_rows(model, paged, rows, args)
            result["rows"].append(entry)
            print(json.dumps(entry), flush=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"wall {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
