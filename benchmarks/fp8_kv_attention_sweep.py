"""Split-KV decode attention over an fp8 cache against bf16, per key step and product.

The decode attention of one loop at 128 requests (Ouro-1.4B: 24 layers, 16 heads of 128,
G = 1), each request with a `--context`-token history in its own fragmented pages: one CUDA
graph calls the split-KV kernel once per layer (each layer's KV is read once, far beyond the
L2 cache, as a loop reads it), median of replays. Both caches run the engine's heuristic
(`choose_splits`); then, for each product of `--products` (`split_config.PRODUCTS`: the
tensor-core tile's rows by keys or keys by rows, or `vector`, CUDA-core multiply-and-sum for one
row per tile), fp8 runs its candidate (block_n, warps, stages) and bf16 a few. Reports
microseconds per loop and KV bytes per second, the best configurations and their
`RLT_FP8_SPLIT_DECODE` / `RLT_SPLIT_DECODE` values. Run on a GPU:

    python3 benchmarks/fp8_kv_attention_sweep.py --out fp8_kv_attention_sweep.json
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, replace

from harness import Timer, parser, record, write_json

LAYERS, HEADS, HEAD_DIM, BLOCK = 24, 16, 128, 16
PRODUCTS = ("rows_by_keys", "keys_by_rows", "vector")  # rlt_attention.split_config.PRODUCTS


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--context", type=int, default=1100)
    p.add_argument("--products", default=",".join(PRODUCTS), help="comma-separated, of these")
    args = p.parse_args(argv)
    import torch
    from rlt_attention import split_config
    from rlt_attention import split_decode_kernel as sdk
    from rlt_attention.kv_store import quantize

    timer = Timer("cuda", replays=10, warmup=2)

    def time_graph(calls) -> float:  # us per replay of one graph of the calls
        replay, _ = timer.capture(calls)
        return timer.median_ms(replay) * 1000

    rows, context = args.rows, args.context
    pages = -(-context // BLOCK)
    blocks = rows * pages
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (LAYERS, blocks, BLOCK, HEADS, HEAD_DIM)
    key = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    value = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    scale = torch.full((LAYERS,), 2.0**-6, device="cuda")
    key8 = torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn)
    value8 = torch.empty_like(key8)
    for layer in range(LAYERS):  # a layer at a time: the fp32 temporaries stay small
        key8[layer] = quantize(key[layer], scale[layer])
        value8[layer] = quantize(value[layer], scale[layer])
    tables = torch.randperm(blocks, device="cuda", generator=generator).to(torch.int32)
    tables = tables.view(rows, pages)
    query = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    query_start = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    lengths = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    heuristic = {
        fp8: split_config.choose_splits(
            num_groups=rows,
            num_kv_heads=HEADS,
            max_context_len=context,
            queries_per_kv=1,
            head_dim=HEAD_DIM,
            sm_count=sm_count,
            kv_fp8=fp8,
        )
        for fp8 in (False, True)
    }

    def loop(split, fp8: bool):
        def calls():
            for layer in range(LAYERS):
                scales = {}
                if fp8:
                    scales = dict(
                        key_scale=scale[layer : layer + 1], value_scale=scale[layer : layer + 1]
                    )
                sdk.launch_split_decode_attention(
                    out,
                    query,
                    (key8 if fp8 else key)[layer],
                    (value8 if fp8 else value)[layer],
                    tables,
                    query_start,
                    lengths,
                    split=split,
                    **scales,
                )

        return calls

    kv_bytes = {
        fp8: 2 * LAYERS * rows * context * HEADS * HEAD_DIM * (1 if fp8 else 2)
        for fp8 in (False, True)
    }
    results = []

    def measure(name, split, fp8):
        us = time_graph(loop(split, fp8))
        tb_per_s = round(kv_bytes[fp8] / (us * 1e-6) / 1e12, 3)
        kv = "fp8" if fp8 else "bf16"
        results.append(dict(kv=kv, config=name, split=asdict(split), us_per_loop=round(us, 1)))
        results[-1]["kv_tb_per_s"] = tb_per_s
        print(f"{kv:5s} {name:24s} {us:9.1f} us  {tb_per_s:.2f} TB/s", flush=True)

    measure("heuristic", heuristic[False], False)
    measure("heuristic", heuristic[True], True)
    # the heuristic's splits (the RLT_*SPLIT_DECODE overrides set the key step and product only)
    tensor_core = list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))
    vector = list(itertools.product((16, 32, 64), (1, 2, 4), (1, 2, 3)))
    vector += list(itertools.product((128,), (4, 8), (2, 3)))
    candidates = {  # product: (fp8 candidates, bf16 candidates)
        "rows_by_keys": (tensor_core, []),
        "keys_by_rows": (tensor_core, list(itertools.product((64, 128), (4, 8), (2, 3)))),
        "vector": (vector, list(itertools.product((32, 64), (2, 4), (2, 3)))),
    }
    for product in args.products.split(","):
        for fp8, grid in zip((True, False), candidates[product], strict=True):
            for block_n, warps, stages in grid:
                fields = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                split = replace(heuristic[fp8], product=product, **fields)
                measure(f"n{block_n}_w{warps}_st{stages}_{product}", split, fp8)

    def best_of(kv):
        return min((r for r in results if r["kv"] == kv), key=lambda r: r["us_per_loop"])

    def env(line):
        split = line["split"]
        fields = [split[k] for k in ("block_n", "num_warps", "num_stages")]
        return ",".join(map(str, [*fields, split_config.PRODUCTS.index(split["product"])]))

    fp8_results = [r for r in results if r["kv"] == "fp8"]
    best, best_bf16 = best_of("fp8"), best_of("bf16")
    bf16 = results[0]["us_per_loop"]
    summary = dict(
        rows=rows,
        context=context,
        bf16_us_per_loop=bf16,
        bf16_best=best_bf16,
        fp8_heuristic_us_per_loop=fp8_results[0]["us_per_loop"],
        fp8_best=best,
        fp8_best_speedup_over_bf16=round(bf16 / best["us_per_loop"], 3),
        fp8_best_speedup_over_bf16_best=round(best_bf16["us_per_loop"] / best["us_per_loop"], 3),
        env=env(best),
        # the model-dtype override only where it beats the heuristic by more than 2%
        bf16_env=env(best_bf16) if best_bf16["us_per_loop"] < 0.98 * bf16 else "",
    )
    print(summary, flush=True)
    write_json(args.out, record("fp8_kv_attention_sweep", args, summary=summary, results=results))


if __name__ == "__main__":
    main()
