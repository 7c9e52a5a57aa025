"""GPU sweep of the small-batch decode kernels, timed as a decode loop sees them.

Every measurement is a CUDA graph over all 24 layers' distinct weights or KV (the L2 cache holds
none of them between calls, as in a loop), median of graph replays timed with CUDA events:

  (a) gemm: each projection of an Ouro-1.4B layer (qkv, o, gate_up, down) at 1-16 rows through
      cuBLAS (`F.linear`, and `torch.mv` at one row) and every `small_batch_linear` config, in
      us per call and weight GB/s;
  (b) attention: the split-KV decode kernels at 1-16 rows over a ~1.1K context, for a grid of
      (num_splits, block_n, num_warps, num_stages), us per layer call (store + split + combine);
  (c) loop: one fused recurrent step with the selection the engine makes today against the best
      of (a) and (b) forced in, and against each projection's fastest one-row kernel (at one
      row), fastest tensor-core tile, and cuBLAS, forced in (a kernel's cost inside a loop
      includes what it does to its neighbours: cuBLAS breaks the programmatic-dependent-launch
      chain).

  python3 benchmarks/small_batch_sweep.py --out sweep.json    # H200, a few minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import Timer, ouro_1_4b_on_cuda  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="batch sizes (comma separated)")
    parser.add_argument("--context", type=int, default=1088)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--skip-attention", action="store_true", help="no split sweep: loops keep the default"
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def bench_gemms(model, rows_list, timer) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from rlt_models import small_batch_linear as sbl

    layers = model.layers
    projections = {
        "qkv": [layer.qkv_proj for layer in layers],
        "o": [layer.o_proj for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj for layer in layers],
        "down": [layer.mlp.down_proj for layer in layers],
    }
    results = []
    for rows in rows_list:
        for name, weights in projections.items():
            n, k = weights[0].shape
            x = torch.randn(rows, k, dtype=weights[0].dtype, device="cuda")
            impls = {"cublas": lambda w, x=x: F.linear(x, w)}
            if rows == 1:
                impls["cublas_mv"] = lambda w, x=x: torch.mv(w, x[0])
            for config in all_configs():
                if config.single_row and rows != 1:
                    continue
                impls[_config_name(config)] = lambda w, x=x, c=config: sbl.launch(x, w, c)
            for impl, fn in impls.items():
                us = time_per_call(timer, fn, weights)
                results.append(
                    {
                        "rows": rows,
                        "projection": name,
                        "impl": impl,
                        "us": round(us, 3),
                        "weight_gb_per_s": round(n * k * 2 / (us * 1e-6) / 1e9, 1),
                    }
                )
        print(f"gemm rows={rows} done", flush=True)
    return results


def all_configs():
    """The engine's candidate tiles plus a few more one-row and few-row shapes."""
    from rlt_models.small_batch_linear import CONFIGS, TileConfig

    extra = (
        TileConfig(4, 256, 2, 4, single_row=True),
        TileConfig(4, 1024, 4, 2, single_row=True),
        TileConfig(2, 1024, 2, 3, single_row=True),
        TileConfig(8, 128, 2, 6, single_row=True),
        TileConfig(16, 128, 4, 6),
        TileConfig(16, 64, 2, 8),
    )
    return CONFIGS + extra


def time_per_call(timer, fn, items) -> float:
    """us per call of fn(item), from a CUDA graph of one call per item."""
    items = list(items)
    run, _ = timer.capture(lambda: [fn(item) for item in items])
    return timer.median_ms(run) * 1e3 / len(items)


def call_layer(bound, query, new_kv, layer):
    return bound(layer, query, new_kv, new_kv)


def fixed_split(split, **_):
    return split


def _config_name(config) -> str:
    kind = "row" if config.single_row else "tile"
    return f"{kind}_n{config.block_n}_k{config.block_k}_w{config.num_warps}_s{config.num_stages}"


def split_grid():
    return itertools.product((8, 12, 17, 24, 32, 48, 64), (16, 32, 64), (2, 4), (1, 2, 3))


def bench_attention(model, paged, rows_list, timer) -> list[dict]:
    """One layer call of the Triton backend (KV store, split, combine) per candidate split
    configuration, forced in through `choose_splits` (the backend looks it up per call)."""
    import torch
    from rlt_attention import TritonPagedAttention, split_config

    config = model.config
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    original_choose = split_config.choose_splits
    dtype = paged.kv.key_cache.dtype
    results = []
    for rows in rows_list:
        batch = paged.batch(rows)
        query = torch.randn(rows, heads, head_dim, dtype=dtype, device="cuda")
        new_kv = torch.randn(rows, kv_heads, head_dim, dtype=dtype, device="cuda")
        default = original_choose(
            num_groups=rows,
            num_kv_heads=kv_heads,
            max_context_len=batch.max_context_len,
            queries_per_kv=heads // kv_heads,
            head_dim=head_dim,
            sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        )
        candidates = [("default", default)]
        for splits, block_n, warps, stages in split_grid():
            if splits <= math.ceil(batch.max_context_len / block_n):
                name = f"s{splits}_n{block_n}_w{warps}_st{stages}"
                candidates.append(
                    (
                        name,
                        replace(
                            default,
                            num_splits=splits,
                            block_n=block_n,
                            num_warps=warps,
                            num_stages=stages,
                        ),
                    )
                )
        for name, split in candidates:
            split_config.choose_splits = partial(fixed_split, split)
            bound = TritonPagedAttention().bind(paged.kv, batch)
            us = time_per_call(
                timer,
                partial(call_layer, bound, query, new_kv),
                range(config.num_hidden_layers),
            )
            results.append(
                {
                    "rows": rows,
                    "config": name,
                    "split": asdict(split),
                    "us": round(us, 3),
                    "kv_gb_per_s": round(paged.kv_bytes_read(rows) / (us * 1e-6) / 1e9, 1),
                }
            )
        split_config.choose_splits = original_choose
        print(f"attention rows={rows} done", flush=True)
    return results


def bench_loops(model, paged, rows_list, timer, gemms, attention) -> list[dict]:
    """The fused loop with today's selection, then with the sweep's best choices forced in."""
    import torch
    from rlt_attention import TritonPagedAttention, split_config
    from rlt_models import small_batch_linear as sbl

    configs = {_config_name(c): c for c in all_configs()}
    shapes = {
        name: tuple(w.shape)
        for name, w in {
            "qkv": model.layers[0].qkv_proj,
            "o": model.layers[0].o_proj,
            "gate_up": model.layers[0].mlp.gate_up_proj,
            "down": model.layers[0].mlp.down_proj,
        }.items()
    }
    original_choose = split_config.choose_splits
    results = []
    for rows in rows_list:
        gen = torch.Generator(device="cuda").manual_seed(100 + rows)
        tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen, device="cuda")
        hidden = model.embed(tokens)
        positions = torch.full((rows,), paged.context - 1, dtype=torch.long, device="cuda")
        batch = paged.batch(rows)
        bucket = 1 << (rows - 1).bit_length()
        model.fused_path = "triton"
        variants = ("engine", "sweep_best", "row_best", "tile_best", "cublas")
        for variant in variants if rows == 1 else [v for v in variants if v != "row_best"]:
            sbl.small_batch_linear.choices.clear()
            split_config.choose_splits = original_choose
            chosen = {}
            if variant != "engine":  # each projection's fastest impl of the variant's kind
                kind = {"sweep_best": "", "row_best": "row_", "tile_best": "tile_"}.get(variant)
                for name, shape in shapes.items():
                    entries = [g for g in gemms if g["rows"] == rows and g["projection"] == name]
                    if kind is None:
                        best = next(g for g in entries if g["impl"] == "cublas")
                    else:
                        best = min(
                            (g for g in entries if g["impl"].startswith(kind)),
                            key=lambda g: g["us"],
                        )
                    chosen[name] = best["impl"]
                    key = (bucket, *shape, model.dtype, hidden.device)
                    sbl.small_batch_linear.choices[key] = configs.get(best["impl"])
                splits = [a for a in attention if a["rows"] == rows]
                if variant == "sweep_best" and splits:
                    best_split = min(splits, key=lambda a: a["us"])
                    chosen["attention"] = best_split["config"]
                    best = split_config.SplitConfig(**best_split["split"])
                    split_config.choose_splits = partial(fixed_split, best)
            bound = TritonPagedAttention().bind(paged.kv, batch)
            run, _ = timer.capture(
                partial(model.recurrent_step, hidden, positions, bound, compute_gate=True)
            )
            results.append(
                {
                    "rows": rows,
                    "variant": variant,
                    "ms_per_loop": round(timer.median_ms(run), 4),
                    "chosen": chosen
                    or {
                        str(k[1:3]): (None if v is None else _config_name(v))
                        for k, v in sbl.small_batch_linear.choices.items()
                    },
                }
            )
        print(f"loop rows={rows} done", flush=True)
    split_config.choose_splits = original_choose
    return results


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    started = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    model, paged = ouro_1_4b_on_cuda(max(rows_list), args.context)
    timer = Timer("cuda", args.replays, 5)
    with torch.no_grad():
        gemms = bench_gemms(model, rows_list, timer)
        attention = [] if args.skip_attention else bench_attention(model, paged, rows_list, timer)
        if args.out:  # keep the sweeps if the loop part fails
            args.out.write_text(json.dumps({"gemm": gemms, "attention": attention}))
        loops = bench_loops(model, paged, rows_list, timer, gemms, attention)
    result = {
        "benchmark": "small_batch_sweep",
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": args.context,
        "gemm": gemms,
        "attention": attention,
        "loop": loops,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    for rows in rows_list:
        for name in ("qkv", "o", "gate_up", "down"):
            entries = [g for g in gemms if g["rows"] == rows and g["projection"] == name]
            cublas = next(g for g in entries if g["impl"] == "cublas")
            best = min(entries, key=lambda g: g["us"])
            print(f"rows {rows} {name}: cublas {cublas['us']} us, best {best['impl']} {best['us']}")
        entries = [a for a in attention if a["rows"] == rows]
        if not entries:
            continue
        default = next(a for a in entries if a["config"] == "default")
        best = min(entries, key=lambda a: a["us"])
        print(
            f"rows {rows} attention: default {default['us']} us, best {best['config']} {best['us']}"
        )
    for loop in loops:
        print(
            f"loop rows {loop['rows']} {loop['variant']}: {loop['ms_per_loop']} ms {loop['chosen']}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"wall {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
