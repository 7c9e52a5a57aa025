"""The decode profile of offline_throughput.py's `--profile-steps`: torch.profiler over a
window of pure-decode engine steps at full concurrency, summarized per loop (GPU busy fraction,
kernels and GPU ms per loop, weight-GEMM ms per loop, the costliest kernels)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from harness import sync

# Substrings (lower case) of kernel names counted as weight GEMMs in the profile summary.
# cuBLAS/CUTLASS kernels, the small-batch Triton GEMVs (rlt_models.small_batch_linear) and the
# batch-invariant Triton GEMM
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "_linear_kernel")


def profile_decode_window(engine, args, prompts, params) -> dict:
    """Profile `--profile-steps` engine steps of pure decode at full concurrency.

    max_num_seqs requests ("profile-i": the workload's prompts cut to --profile-prompt-len,
    max_tokens = --output-len) are admitted and stepped until every one has its first token
    (prefill done) plus one more step; then the device is synchronized, torch.profiler
    (activities CPU + CUDA; CPU only off CUDA) records N engine.step() calls and a final
    synchronize, and the requests are aborted. The trace is exported as a chrome trace and
    summarized by `summarize_trace` over the window's N submitted steps' decode ticks (from
    step_log). Profiling adds host overhead, so the busy fraction is a lower bound for the
    unprofiled loop.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = args.device.startswith("cuda")
    n = args.max_num_seqs
    plen = min(args.profile_prompt_len or args.prompt_len, args.prompt_len)
    ids = [f"profile-{i}" for i in range(n)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompts[i % len(prompts)][:plen], params)
    started, finished = set(), set()

    def step():
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                finished.add(out.request_id)

    guard = 0
    while len(started | finished) < n and engine.has_unfinished_requests():
        step()
        guard += 1
        if guard > 100_000:
            raise RuntimeError("profile window: prefill never completed")
    step()  # one more: the pipeline now holds a pure decode step
    finished_before = len(finished)
    core = engine.core
    core.step_log = []
    sync(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        sync(args.device)
        host_window_s = time.perf_counter() - t0
    step()  # applies the window's last submitted step
    records, core.step_log = core.step_log, None
    for request_id in ids:
        if request_id not in finished:
            engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    # With one step in flight, the window's first step() applied the step submitted before it.
    skip = 1 if core.async_scheduling else 0
    window = records[skip : skip + args.profile_steps]
    ticks = sum(r.decode_ticks for r in window)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    summary = summarize_trace(trace, ticks)
    summary |= {"steps": args.profile_steps, "window_steps_found": len(window), "rows": n}
    summary |= {"decode_ticks": ticks, "prompt_len": plen, "torch_version": torch.__version__}
    summary["prefill_tokens_in_window"] = sum(r.prefill_tokens for r in window)
    summary["generated_in_window"] = sum(r.generated for r in window)
    summary["requests_finished_before_window"] = finished_before
    summary["requests_finished_in_window"] = len(finished) - finished_before
    summary["host_window_ms"] = round(1000 * host_window_s, 3)
    summary["host_ms_per_step"] = round(1000 * host_window_s / args.profile_steps, 3)
    return summary


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize_trace(trace: dict, ticks: int, top: int = 10) -> dict:
    """Summarize a kineto chrome trace (torch.profiler export_chrome_trace).

    Assumes the kineto format: trace["traceEvents"] holds complete events (ph "X") with ts and
    dur in microseconds; GPU kernels have cat "kernel" (any case), memcpy/memset cat
    "gpu_memcpy"/"gpu_memset"; host API calls cat "cuda_runtime"/"cuda_driver" (graph
    launches named cudaGraphLaunch*/cuGraphLaunch*); kernels and their launch call share
    args["correlation"]. Fields:
      kernel_events_seen: any kernel event at all; graph_launches: graph launch API calls;
      graph_kernels: kernels whose correlation id is a graph launch's (0 with graph_launches >
        0 means graph-replay kernels are missing: the GPU numbers then cover eager kernels only
        and graph_kernels_seen is false);
      kernels: kernel count; kernel_span_ms: first kernel start to last kernel end;
      gpu_busy_fraction: union of kernel intervals / kernel_span (gaps between kernels are idle
        time, whatever their cause);
      kernels_per_loop: kernels / ticks; gpu_ms_per_loop: union of kernel intervals / ticks
        (kernels launched with programmatic dependent launch start while their predecessor
        drains and wait resident, so their durations overlap: a sum would count that twice);
      span_ms_per_loop: kernel_span / ticks (busy plus idle gaps);
      gemm_ms_per_loop: sum of the durations of kernels named like GEMMs (GEMM_MARKERS) / ticks
        (with PDL it includes the time they waited resident for their predecessors);
      memcpy_count / memcpy_ms: memcpy + memset events; top_kernels: the `top` kernels by total
      time (name, count, total_ms). GPU fields are null when no kernel event was seen.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    kernels, copies, graph_corr = [], [], set()
    graph_launches = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat == "kernel":
            kernels.append(ev)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies.append(ev)
        elif cat in ("cuda_runtime", "cuda_driver") and "graphlaunch" in ev.get("name", "").lower():
            graph_launches += 1
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                graph_corr.add(corr)
    graph_kernels = sum(
        1 for k in kernels if (k.get("args") or {}).get("correlation") in graph_corr
    )
    out = {
        "kernel_events_seen": bool(kernels),
        "graph_launches": graph_launches,
        "graph_kernels": graph_kernels,
        "graph_kernels_seen": graph_launches == 0 or graph_kernels > 0,
        "kernels": len(kernels),
        "memcpy_count": len(copies),
        "memcpy_ms": round(sum(float(c.get("dur", 0)) for c in copies) / 1000, 3),
        "kernel_span_ms": None,
        "gpu_busy_fraction": None,
        "kernels_per_loop": None,
        "gpu_ms_per_loop": None,
        "span_ms_per_loop": None,
        "gemm_ms_per_loop": None,
        "top_kernels": [],
    }
    if not kernels:
        return out
    spans = [(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    busy = union_us(spans)
    gemm = sum(
        float(k.get("dur", 0))
        for k in kernels
        if any(m in k.get("name", "").lower() for m in GEMM_MARKERS)
    )
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        entry = by_name.setdefault(k.get("name", "?"), [0, 0.0])
        entry[0] += 1
        entry[1] += float(k.get("dur", 0))
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    out.update(
        kernel_span_ms=round((last - first) / 1000, 3),
        gpu_busy_fraction=round(busy / (last - first), 4) if last > first else None,
        kernels_per_loop=round(len(kernels) / ticks, 2) if ticks else None,
        gpu_ms_per_loop=round(busy / 1000 / ticks, 4) if ticks else None,
        span_ms_per_loop=round((last - first) / 1000 / ticks, 4) if ticks else None,
        gemm_ms_per_loop=round(gemm / 1000 / ticks, 4) if ticks else None,
        top_kernels=[
            {"name": name[:200], "count": count, "total_ms": round(dur / 1000, 3)}
            for name, (count, dur) in ranked
        ],
    )
    return out
