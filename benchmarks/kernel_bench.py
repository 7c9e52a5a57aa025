"""GPU microbenchmark of one Ouro decode loop: fused vs unfused layer ops, split-KV attention.

Builds an Ouro-shaped model with random weights in memory (no checkpoint) and a paged KV cache
(block size 16, one plane) in which every row is a decode query at the same context, then for
each batch size reports:

  (a) attention: one paged-attention layer call (store + read), split-KV decode kernels vs the
      tiled kernel, in us per call and GB/s of K/V read (a CUDA graph of one call per layer,
      so consecutive calls read different layers' KV, as in a loop);
  (b) loop: one recurrent step (all layers + end-of-loop norm + exit gate) captured in a CUDA
      graph, GPU ms per loop from graph replays: fused + split ("fused"), eager layer +
      split ("unfused") and eager layer + tiled kernel ("baseline": the code before both,
      except that both Triton variants share the one-launch KV store kernel);
  (c) gemm_only: the 4 weight GEMMs of every layer alone, in a CUDA graph (the floor of (b));
  (d) kernels: GPU kernels (and memcpy/memset) of one eager loop of each path, from
      torch.profiler.

Times are the median of --replays graph replays, each timed with CUDA events after warm-up.
`--device cpu --tiny` is a smoke mode (a tiny model, torch attention and the torch paths,
wall-clock timing, profiler op counts instead of kernels); it says nothing about speed.

  python benchmarks/kernel_bench.py --out kernel_bench.json          # H200, about a minute
  uv run python benchmarks/kernel_bench.py --device cpu --tiny        # smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    total_ut_steps=4,
    max_position_embeddings=4096,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model instead of Ouro-1.4B")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated decode rows (default 1,32,128; with --tiny 1,4)",
    )
    parser.add_argument(
        "--context", type=int, default=None, help="context of every row (default 1088; tiny 64)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--replays", type=int, default=100, help="timed replays (>= 50 advised)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.batch_sizes is None:
        args.batch_sizes = "1,4" if args.tiny else "1,32,128"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.context is None:
        args.context = 64 if args.tiny else 1088
    if args.device == "cpu" and args.replays > 20:
        args.replays = 5 if args.tiny else 20
        args.warmup = min(args.warmup, 2)
    return args


# ---------------------------------------------------------------------------------------------
# setup


def build_random_model(config, dtype, device, seed):
    """OuroModel with random weights written in place (norm weights near 1, projections 0.02)."""
    import torch
    from rlt_models import OuroModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created directly in the model dtype
    try:
        with torch.device(device):
            model = OuroModel(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.normal_(1.0, 0.1, generator=generator)
            elif name.startswith("early_exit_gate"):
                param.normal_(0.0, 0.05, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def ouro_1_4b_on_cuda(max_batch: int, context: int):
    """(model, PagedSetup): a random Ouro-1.4B-shaped bf16 model on CUDA and a KV cache of
    block size 16 for `max_batch` rows at `context` (the small-batch decode benchmarks')."""
    import torch
    from rlt_models import OuroConfig

    config = OuroConfig.ouro_1_4b()
    model = build_random_model(config, torch.bfloat16, "cuda", 0)
    paged = PagedSetup(
        config,
        max_batch=max_batch,
        context=context,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=0,
    )
    return model, paged


class PagedSetup:
    """A KV cache for the largest batch and, per batch size, the decode metadata of B rows at
    context `context` (full-width tables, as the runner's decode graphs bind them)."""

    def __init__(self, config, *, max_batch, context, block_size, dtype, device, seed):
        import torch
        from rlt_contracts import KVCacheTensors

        self.context = context
        self.block_size = block_size
        self.pages = math.ceil(context / block_size)
        num_blocks = max_batch * self.pages
        shape = (
            config.num_hidden_layers,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        key = torch.empty(shape, dtype=dtype, device=device).normal_(generator=generator)
        value = torch.empty(shape, dtype=dtype, device=device).normal_(generator=generator)
        self.kv = KVCacheTensors(key, value)
        # fragmented, non-monotonic block order
        cpu_gen = torch.Generator().manual_seed(seed + 2)
        self.order = torch.randperm(num_blocks, generator=cpu_gen).to(torch.int32)
        self.device = device

    def batch(self, rows: int):
        import torch
        from rlt_contracts import PagedAttentionBatch

        device = self.device
        tables = self.order[: rows * self.pages].view(rows, self.pages).to(device)
        position = self.context - 1
        last_block = tables[:, position // self.block_size].to(torch.int64)
        return PagedAttentionBatch(
            query_start=torch.arange(rows + 1, dtype=torch.int32, device=device),
            context_lengths=torch.full((rows,), self.context, dtype=torch.int32, device=device),
            block_tables=tables,
            write_slots=last_block * self.block_size + position % self.block_size,
            max_query_len=1,
            max_context_len=self.pages * self.block_size,
        )

    def kv_bytes_read(self, rows: int) -> int:
        key = self.kv.key_cache
        _, _, _, kv_heads, head_dim = key.shape
        return 2 * rows * self.context * kv_heads * head_dim * key.element_size()


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    """Median time (ms) of a callable: CUDA graph replays timed with events on CUDA, wall-clock
    time of eager calls on CPU."""

    def __init__(self, device: str, replays: int, warmup: int) -> None:
        self.cuda = device == "cuda"
        self.replays = replays
        self.warmup = warmup

    def capture(self, fn):
        """CUDA: (graph.replay, outputs of the captured call). CPU: (fn, None)."""
        if not self.cuda:
            return fn, None
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels, settle the allocator
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph._keep_alive = out  # the outputs live in the graph pool
        return graph.replay, out

    def median_ms(self, run) -> float:
        if not self.cuda:
            for _ in range(self.warmup):
                run()
            times = []
            for _ in range(self.replays):
                start = time.perf_counter()
                run()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        import torch

        for _ in range(self.warmup):
            run()
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.replays)
        ]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def count_kernels(fn, device: str) -> dict:
    """GPU kernels and memcpy/memset of one eager call (CPU: top-level aten ops)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device == "cuda":
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names: dict[str, dict] = {}
        copies = 0
        for event in prof.events():
            if event.device_type != DeviceType.CUDA:
                continue
            if event.name.startswith(("Memcpy", "Memset")):
                copies += 1
                continue
            entry = names.setdefault(event.name, {"count": 0, "us": 0.0})
            entry["count"] += 1
            entry["us"] += event.time_range.elapsed_us()
        return {
            "kernels": sum(e["count"] for e in names.values()),
            "memcpy_memset": copies,
            "kernel_us": sum(e["us"] for e in names.values()),
            "by_name": dict(sorted(names.items(), key=lambda item: -item[1]["us"])),
        }
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {}
    for event in prof.events():
        if event.name.startswith("aten::") and event.cpu_parent is None:
            entry = names.setdefault(event.name, {"count": 0, "us": 0.0})
            entry["count"] += 1
            entry["us"] += event.time_range.elapsed_us()
    return {
        "kernels": sum(e["count"] for e in names.values()),
        "memcpy_memset": 0,
        "kernel_us": sum(e["us"] for e in names.values()),
        "by_name": dict(sorted(names.items(), key=lambda item: -item[1]["us"])),
    }


# ---------------------------------------------------------------------------------------------
# the measurements


def attention_backends(device: str) -> dict:
    from rlt_attention import TorchPagedAttention, TritonPagedAttention

    if device == "cuda":
        return {
            "split": TritonPagedAttention(),
            "tiled": TritonPagedAttention(split_kv=False),
        }
    return {"torch": TorchPagedAttention()}


def loop_paths(device: str) -> dict:
    """name -> (model.fused_path, attention backend name)."""
    if device == "cuda":
        return {
            "fused": ("triton", "split"),
            "unfused": ("off", "split"),
            "baseline": ("off", "tiled"),
        }
    return {"fused": ("torch", "torch"), "unfused": ("off", "torch")}


def bench_attention(model, paged, backends, rows, timer, dtype, device) -> list[dict]:
    import torch
    from rlt_attention import split_config

    config = model.config
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    query = randn(rows, config.num_attention_heads, config.head_dim)
    key = randn(rows, config.num_key_value_heads, config.head_dim)
    value = randn(rows, config.num_key_value_heads, config.head_dim)
    layers = config.num_hidden_layers
    results = []
    for name, backend in backends.items():
        bound = backend.bind(paged.kv, paged.batch(rows))

        def one_per_layer(bound=bound):
            return [bound(layer, query, key, value) for layer in range(layers)]

        run, _ = timer.capture(one_per_layer)
        us = timer.median_ms(run) * 1e3 / layers
        entry = {
            "batch": rows,
            "kernel": name,
            "us_per_call": us,
            "kv_gb_per_s": paged.kv_bytes_read(rows) / (us * 1e-6) / 1e9,
        }
        if name == "split":
            entry["num_splits"] = split_config.choose_splits(
                num_groups=rows,
                num_kv_heads=config.num_key_value_heads,
                max_context_len=paged.pages * paged.block_size,
                queries_per_kv=config.num_attention_heads // config.num_key_value_heads,
                head_dim=config.head_dim,
                sm_count=(
                    torch.cuda.get_device_properties(device).multi_processor_count
                    if device == "cuda"
                    else split_config.DEFAULT_SM_COUNT
                ),
            ).num_splits
        results.append(entry)
    return results


def bench_loops(model, paged, backends, rows, timer, device) -> tuple[list[dict], list]:
    """Loop timings, and (batch, path, fused_path, loop) to count kernels of once timing is done
    (a profiler session slows what runs after it on some machines)."""
    import torch

    config = model.config
    gen = torch.Generator(device=device).manual_seed(100 + rows)
    token_ids = torch.randint(0, config.vocab_size, (rows,), generator=gen, device=device)
    hidden = model.embed(token_ids)
    positions = torch.full((rows,), paged.context - 1, dtype=torch.long, device=device)
    batch = paged.batch(rows)
    timings, to_count = [], []
    for name, (fused_path, backend_name) in loop_paths(device).items():
        model.fused_path = fused_path
        bound = backends[backend_name].bind(paged.kv, batch)

        def loop(bound=bound):
            return model.recurrent_step(hidden, positions, bound, compute_gate=True)

        run, _ = timer.capture(loop)
        timings.append({"batch": rows, "path": name, "ms_per_loop": timer.median_ms(run)})
        to_count.append((rows, name, fused_path, loop))
    model.fused_path = "auto"
    return timings, to_count


def bench_gemms(model, rows, timer, dtype, device) -> dict:
    import torch
    import torch.nn.functional as F

    config = model.config
    gen = torch.Generator(device=device).manual_seed(200 + rows)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    x = randn(rows, config.hidden_size)
    attn = randn(rows, config.num_attention_heads * config.head_dim)
    act = randn(rows, config.intermediate_size)

    def gemms():
        outs = []
        for layer in model.layers:
            outs.append(F.linear(x, layer.qkv_proj))
            outs.append(F.linear(attn, layer.o_proj))
            outs.append(F.linear(x, layer.mlp.gate_up_proj))
            outs.append(F.linear(act, layer.mlp.down_proj))
        return outs[-1]

    run, _ = timer.capture(gemms)
    weight_bytes = sum(
        p.numel() * p.element_size()
        for layer in model.layers
        for p in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    ms = timer.median_ms(run)
    return {"batch": rows, "ms": ms, "weight_gb_per_s": weight_bytes / (ms * 1e-3) / 1e9}


def print_table(results: dict) -> None:
    attention = {(r["batch"], r["kernel"]): r for r in results["attention"]}
    loops = {(r["batch"], r["path"]): r["ms_per_loop"] for r in results["loop"]}
    kernels = {(r["batch"], r["path"]): r["kernels"] for r in results["kernels_per_loop"]}
    gemm = {r["batch"]: r["ms"] for r in results["gemm_only"]}
    att_names = sorted({k for _, k in attention}, key=["split", "tiled", "torch"].index)
    paths = list(dict.fromkeys(p for _, p in loops))
    unit = "ms wall (CPU, eager)" if results["device"] == "cpu" else "GPU ms (graph replay)"
    print()
    print(f"== {results['model']}, context {results['context']}, {results['dtype']}, {unit}")
    header = ["batch"]
    header += [f"attn {n} us (GB/s)" for n in att_names]
    header += [f"loop {p} ms" for p in paths] + ["gemm-only ms"]
    header += [f"kernels {p}" for p in paths]
    rows = []
    for batch in results["batch_sizes"]:
        row = [str(batch)]
        for n in att_names:
            a = attention[(batch, n)]
            splits = f" s={a['num_splits']}" if "num_splits" in a else ""
            row.append(f"{a['us_per_call']:.1f} ({a['kv_gb_per_s']:.0f}){splits}")
        row += [f"{loops[(batch, p)]:.3f}" for p in paths]
        row.append(f"{gemm[batch]:.3f}")
        row += [str(kernels[(batch, p)]) for p in paths]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    print("\nkernel time of one eager fused loop (profiler; launch gaps excluded), top entries:")
    for entry in results["kernels_per_loop"]:
        if entry["path"] != "fused":
            continue
        top = list(entry["by_name"].items())[:6]
        shown = ", ".join(f"{name[:28]} {v['us']:.0f}us/{v['count']}" for name, v in top)
        print(f"  batch {entry['batch']}: total {entry['kernel_us']:.0f} us: {shown}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from rlt_models import OuroConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device is available (use --device cpu --tiny)")
        return 2
    started = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a smoke test: small CPU thread pools time erratically
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    device = args.device
    config = OuroConfig(**TINY_SHAPE) if args.tiny else OuroConfig.ouro_1_4b()
    model = build_random_model(config, dtype, device, args.seed)
    paged = PagedSetup(
        config,
        max_batch=max(args.batch_sizes),
        context=args.context,
        block_size=args.block_size,
        dtype=dtype,
        device=device,
        seed=args.seed,
    )
    timer = Timer(device, args.replays, args.warmup)
    backends = attention_backends(device)
    results = {
        "model": "tiny" if args.tiny else "ouro-1.4b",
        "config": {k: v for k, v in vars(config).items() if not isinstance(v, tuple)},
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": args.dtype,
        "context": args.context,
        "block_size": args.block_size,
        "batch_sizes": args.batch_sizes,
        "replays": args.replays,
        "attention": [],
        "loop": [],
        "gemm_only": [],
        "kernels_per_loop": [],
    }
    to_count = []
    with torch.inference_mode():
        for rows in args.batch_sizes:
            results["attention"] += bench_attention(
                model, paged, backends, rows, timer, dtype, device
            )
            timings, loops = bench_loops(model, paged, backends, rows, timer, device)
            results["loop"] += timings
            to_count += loops
            results["gemm_only"].append(bench_gemms(model, rows, timer, dtype, device))
            print(f"batch {rows} timed at {time.perf_counter() - started:.1f} s", flush=True)
        for rows, name, fused_path, loop in to_count:
            model.fused_path = fused_path
            results["kernels_per_loop"].append(
                {"batch": rows, "path": name, **count_kernels(loop, device)}
            )
        model.fused_path = "auto"
    results["wall_s"] = time.perf_counter() - started
    print_table(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
