"""Capturing one CUDA graph of the runner (decode ticks, prefill steps, SHARED waves)."""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_RUNS = 2  # eager runs before the recording (they execute; the recording does not)

# One warm-up stream per device for every capture. torch gives each stream that runs a cuBLAS
# call its own workspace (32 MiB on Hopper), kept for the life of the process: a new stream
# per capture held one per stream of torch's pool (33 of them, 1.04 GiB on an H100) after an
# engine's ~20 captures, memory no engine could use and shutdown could not return.
_warmup_streams: dict[int, torch.cuda.Stream] = {}


def warmup_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    stream = _warmup_streams.get(device)
    if stream is None:
        stream = _warmup_streams[device] = torch.cuda.Stream(device)
    return stream


def capture(run: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """Record `run` (device work on persistent buffers only) into a graph in memory pool
    `pool`. It runs WARMUP_RUNS times on a side stream first: Triton compilation, autotuning
    and one-time allocations must happen outside the capture. Whatever `run` writes in those
    warm-ups is the caller's to make harmless (inactive rows, invalid inputs writing the
    scratch slot, records in spare ring rows)."""
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph
