"""Host cost against GPU cost of one depth-major prefill step (CUDA only).

A prefill step of the c32 row (two 1,024-token prompt chunks, all 4 loops of a random
Ouro-1.4B-shaped bf16 model, Triton paged attention) runs eagerly: the host launches every
kernel of 4 x 24 layers. This measures, side by side in one process:

- `gpu_ms`: the same step captured in a CUDA graph and replayed (device time only);
- `enqueue_ms`: host time to launch the step eagerly on an idle device (nothing waits);
- `eager_ms`: wall time of the eager step up to its completion;
- with programmatic dependent launch on and off, and the host functions that take the most
  time in one eager step (cProfile, total time per function).

If `enqueue_ms` exceeds `gpu_ms`, prefill steps are bound by the host's launches.

    python3 benchmarks/prefill_host_cost.py --out /tmp/prefill_host_cost.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import Timer, ouro_1_4b_on_cuda  # noqa: E402

CHUNKS, CHUNK_LEN = 2, 1024


def prefill_batch(paged, device):
    """Two chunks of CHUNK_LEN positions from position 0, packed, with their KV write slots."""
    import torch
    from rlt_contracts import PagedAttentionBatch

    tables = paged.order[: CHUNKS * paged.pages].view(CHUNKS, paged.pages).to(device)
    positions = torch.arange(CHUNK_LEN, device=device).repeat(CHUNKS)
    group = torch.arange(CHUNKS, device=device).repeat_interleave(CHUNK_LEN)
    blocks = tables[group, positions // paged.block_size].to(torch.int64)
    batch = PagedAttentionBatch(
        query_start=torch.arange(CHUNKS + 1, dtype=torch.int32, device=device) * CHUNK_LEN,
        context_lengths=torch.full((CHUNKS,), CHUNK_LEN, dtype=torch.int32, device=device),
        block_tables=tables,
        write_slots=blocks * paged.block_size + positions % paged.block_size,
        max_query_len=CHUNK_LEN,
        max_context_len=CHUNK_LEN,
    )
    return batch, positions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    import torch
    from rlt_attention import TritonPagedAttention
    from rlt_contracts import dependent_launch

    model, paged = ouro_1_4b_on_cuda(max_batch=CHUNKS, context=CHUNK_LEN)
    batch, positions = prefill_batch(paged, "cuda")
    tokens = torch.randint(0, model.shape.vocab_size, (CHUNKS * CHUNK_LEN,), device="cuda")
    attention = TritonPagedAttention()

    def step():
        hidden = model.embed(tokens)
        for _ in range(model.shape.num_loops):
            bound = attention.bind(paged.kv, batch)
            hidden, _ = model.recurrent_step(hidden, positions, bound, compute_gate=False)
        return hidden

    results = {"chunks": CHUNKS, "chunk_len": CHUNK_LEN, "arms": {}}
    timer = Timer("cuda", replays=args.repeats, warmup=3)
    with torch.inference_mode():
        for pdl in (True, False):
            dependent_launch.set_enabled(pdl)
            replay, _ = timer.capture(step)
            gpu_ms = timer.median_ms(replay)
            enqueue, eager = [], []
            for _ in range(args.repeats + 2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                enqueued = time.perf_counter()
                torch.cuda.synchronize()
                enqueue.append((enqueued - start) * 1e3)
                eager.append((time.perf_counter() - start) * 1e3)
            results["arms"]["pdl" if pdl else "no_pdl"] = {
                "gpu_ms": round(gpu_ms, 3),
                "enqueue_ms": round(statistics.median(enqueue[2:]), 3),
                "eager_ms": round(statistics.median(eager[2:]), 3),
            }
            print(pdl, results["arms"]["pdl" if pdl else "no_pdl"], flush=True)
        dependent_launch.set_enabled(None)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        step()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    results["cprofile_top"] = text.getvalue()
    print(results["cprofile_top"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
