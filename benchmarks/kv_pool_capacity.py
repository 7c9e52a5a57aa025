"""How many tokens the KV pool holds with the engine's CUDA defaults, per KV cache dtype.

Each arm starts one engine in its own process (`LLMEngine`, pool sized from free memory:
`num_kv_blocks=None`, max_model_len from the checkpoint), reads the start-up line "KV pool:
... blocks ... tokens ... requests of max_model_len fit at once", and shuts down. Same
checkpoint and memory settings for every arm, so the ratio of tokens is what the cache dtype
buys. Run on a GPU:

    python3 benchmarks/kv_pool_capacity.py --model /tmp/rlt-bench-checkpoints/ouro-1.4b \
        --arm auto --arm fp8 --out kv_pool.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
from pathlib import Path

POOL_LINE = re.compile(
    r"KV pool: (?P<dtype>\S+) (?P<blocks>\d+) blocks of (?P<block>\d+) positions x (?P<planes>\d+)"
    r" plane\(s\) = (?P<tokens>\d+) tokens \((?P<gib>[\d.]+) GiB\); (?P<requests>\d+) requests"
    r" of max_model_len (?P<max_model_len>\d+)"
)


def _start(model: str | None, device: str, kv_dtype: str, queue) -> None:
    import logging

    from rlt.engine import EngineConfig, LLMEngine

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)
    engine = LLMEngine(EngineConfig(model=model, device=device, kv_cache_dtype=kv_dtype))
    engine.shutdown()
    found = [m.groupdict() for m in map(POOL_LINE.search, lines) if m]
    queue.put(found[-1] if found else {"error": "no KV pool line", "lines": lines[-5:]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--arm", action="append", default=None, help="KV cache dtype")
    parser.add_argument("--out")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    results = {}
    for kv_dtype in args.arm or ["auto", "fp8"]:
        queue = context.Queue()
        process = context.Process(target=_start, args=(args.model, args.device, kv_dtype, queue))
        process.start()
        results[kv_dtype] = queue.get()
        process.join()
        print(kv_dtype, json.dumps(results[kv_dtype]), flush=True)
    tokens = {k: int(v["tokens"]) for k, v in results.items() if "tokens" in v}
    if "auto" in tokens and "fp8" in tokens:
        results["fp8_tokens_over_auto"] = round(tokens["fp8"] / tokens["auto"], 3)
        print("fp8 / auto tokens:", results["fp8_tokens_over_auto"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
