"""What capturing the prefill graphs costs (CUDA only): time per bucket, in the order a c32/c128
run meets them, then every remaining bucket, and the memory they take.

Builds one engine of the c128 row (random Ouro-1.4B-shaped bf16 checkpoint, LAST_EXITED,
max_num_seqs 128, max_num_batched_tokens 4096, 1,024-token chunks), timing its construction,
then captures each (token bucket, chunk-count bucket) of `PrefillGraphs` directly, one at a
time with the device synchronized around it. The first capture at a new shape includes the
one-time work of that shape (Triton compilations per specialization, autotuning); later ones
only the two eager warm-up runs, the recording and the instantiation.

    python3 benchmarks/prefill_capture_cost.py --out /tmp/prefill_capture_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import build_parser, ensure_checkpoint  # noqa: E402

# the buckets the c32 timed runs met first (a CPU replay of their scheduling), then small ones
FIRST = [(1024, 1), (2048, 2), (2048, 4), (256, 1), (32, 1), (16, 1), (64, 2), (4096, 4)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    bench = build_parser().parse_args(
        ["--shape", "ouro-1.4b", "--device", "cuda", "--dtype", "bfloat16"]
    )
    import torch
    from rlt import LLMEngine
    from rlt.engine import EngineConfig

    model_dir = ensure_checkpoint(bench)
    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=128,
            max_num_batched_tokens=4096,
            prefill_chunk_size=1024,
            max_model_len=1152,
        )
    )
    torch.cuda.synchronize()
    result = {"engine_build_s": round(time.perf_counter() - start, 2), "captures": []}
    graphs = engine.core.runner.prefill_graphs
    reserved0 = torch.cuda.memory_reserved()
    buckets = list(FIRST)
    width = 16
    while width <= graphs.max_tokens:
        groups = 1
        while groups <= min(graphs.max_groups, width):
            if (width, groups) not in buckets:
                buckets.append((width, groups))
            groups *= 2
        width *= 2
    with torch.inference_mode():
        for width, groups in buckets:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs._graphs[(width, groups)] = graphs._capture(width, groups)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            result["captures"].append({"tokens": width, "groups": groups, "ms": round(ms, 1)})
            print(f"capture ({width}, {groups}): {ms:.1f} ms", flush=True)
    rest = result["captures"][len(FIRST) :]
    result["first_s"] = round(sum(c["ms"] for c in result["captures"][: len(FIRST)]) / 1e3, 2)
    result["rest_s"] = round(sum(c["ms"] for c in rest) / 1e3, 2)
    result["graphs"] = len(result["captures"])
    result["reserved_growth_mib"] = round((torch.cuda.memory_reserved() - reserved0) / 2**20, 1)
    print({k: v for k, v in result.items() if k != "captures"}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
