"""GPU microbenchmark of one paged-attention layer call: rlt's Triton backend vs flash-attn 2.

Ouro-1.4B's attention shape (16 heads, 16 KV heads, head dim 128), bf16 by default, each backend
at its own KV block size (Triton 16, flash-attn 256: its paged KV needs a multiple of 256):

  decode:  B rows, one query each, every row at context --context (default 1088), B in
           --batch-sizes (1,32,128); Triton's split-KV kernels vs flash_attn_with_kvcache
  prefill: B groups of one --prefill-len chunk (1024) ending at --prefill-context (default
           1024: a first chunk; 2048 would be a continuing one), B in --prefill-batches (1,4);
           Triton's tiled kernel vs flash_attn_varlen_func (causal, paged)

A "call" is what the engine does per layer: store the call's keys/values, then attend. Each
timing runs one call per layer of a --layers-deep cache (so consecutive calls read different
KV, as in a loop) and reports us per call, the median of --replays: eager (Python launches
included) and as a CUDA graph replay (the engine's decode path; rlt's flash-attn adapter declares
no graph capture, so its graph numbers, when capture works at all, say what capture would give).
Decode reports the K/V read rate, prefill the attention TFLOP/s (causal: only visible keys).

  python benchmarks/flash_attn_bench.py --out flash_attn_bench.json    # H200, about a minute
  uv run python benchmarks/flash_attn_bench.py --device cpu             # smoke test, seconds

`--device cpu` times the torch backend at both block sizes on tiny sizes (eager, wall clock): it
checks this script, and says nothing about speed.

flash-attn comes from tools/build_flash_attn.sh (its site folder on PYTHONPATH); without it
only Triton runs and the JSON says why.
"""

from __future__ import annotations

import sys
import time
import traceback
from types import SimpleNamespace

from harness import Timer, ints, markdown_table, parser, record, version, write_json
from kernel_bench import PagedSetup

OURO_ATTENTION = dict(num_heads=16, num_kv_heads=16, head_dim=128)


def parse_args(argv=None):
    p = parser(__doc__, dtype="bfloat16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch-sizes", default="1,32,128", help="decode rows")
    p.add_argument("--context", type=int, default=1088, help="decode context of every row")
    p.add_argument("--prefill-len", type=int, default=1024, help="queries per prefill group")
    p.add_argument("--prefill-context", type=int, default=None, help="default: prefill-len")
    p.add_argument("--prefill-batches", default="1,4", help="prefill groups")
    p.add_argument("--layers", type=int, default=8, help="KV layers cycled through")
    p.add_argument("--triton-block-size", type=int, default=16)
    p.add_argument("--flash-block-size", type=int, default=256)
    p.add_argument("--flash-num-splits", type=int, default=0, help="0: flash-attn's choice")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cpu":  # smoke sizes
        args.batch_sizes, args.context, args.prefill_len = "1,2", 300, 40
        args.prefill_batches, args.layers, args.replays, args.warmup = "1,2", 2, 3, 1
        args.no_graphs = True
    args.batch_sizes, args.prefill_batches = ints(args.batch_sizes), ints(args.prefill_batches)
    args.prefill_context = args.prefill_context or args.prefill_len
    if args.prefill_context < args.prefill_len:
        p.error("--prefill-context must be >= --prefill-len")
    return args


def prefill_batch(paged: PagedSetup, rows: int, q_len: int):
    """`rows` groups, each the last q_len positions of a paged.context-long context."""
    import torch
    from rlt_contracts import PagedAttentionBatch

    device, block = paged.device, paged.block_size
    tables = paged.order[: rows * paged.pages].view(rows, paged.pages).to(device)
    positions = torch.arange(paged.context - q_len, paged.context, device=device)
    blocks = tables[:, positions // block].to(torch.int64)  # [rows, q_len]
    return PagedAttentionBatch(
        query_start=torch.arange(rows + 1, dtype=torch.int32, device=device) * q_len,
        context_lengths=torch.full((rows,), paged.context, dtype=torch.int32, device=device),
        block_tables=tables,
        write_slots=(blocks * block + positions % block).reshape(-1),
        max_query_len=q_len,
        max_context_len=paged.context,
    )


def causal_flops(rows: int, q_len: int, context: int, heads: int, head_dim: int) -> float:
    """QK^T and PV multiply-adds over the keys each query sees (bottom-right causal)."""
    visible = sum(context - q_len + i + 1 for i in range(q_len))
    return 4.0 * rows * heads * head_dim * visible


def make_backends(args) -> tuple[dict, str | None]:
    """name -> (backend, block size); and why flash-attn is missing (None when present)."""
    from rlt_attention import FlashAttnBackend, TorchPagedAttention, TritonPagedAttention
    from rlt_attention.flash_attn_backend import flash_attn_unavailable_reason

    if args.device == "cpu":
        return {
            "torch": (TorchPagedAttention(), args.triton_block_size),
            "torch@flash_block": (TorchPagedAttention(), args.flash_block_size),
        }, "smoke test on the CPU"
    backends = {"triton": (TritonPagedAttention(), args.triton_block_size)}
    reason = flash_attn_unavailable_reason()
    if reason is None:
        flash = FlashAttnBackend(num_splits=args.flash_num_splits)
        backends["flash_attn"] = (flash, args.flash_block_size)
    return backends, reason


def time_call(timer: Timer, backend, paged, batch, layers, query, key, value, graphs) -> dict:
    bound = backend.bind(paged.kv, batch)

    def one_per_layer():
        return [bound(layer, query, key, value) for layer in range(layers)]

    if not graphs:
        return {"eager_us": timer.median_ms(one_per_layer) * 1e3 / layers}
    try:
        replay, _ = timer.capture(one_per_layer)
        return {"graph_us": timer.median_ms(replay) * 1e3 / layers}
    except Exception as exc:  # noqa: BLE001 -- reported, not fatal
        return {"graph_us": None, "graph_error": f"{type(exc).__name__}: {exc}"[:300]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device is available (--device cpu: a smoke test)")
        return 2
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim = (
        OURO_ATTENTION["num_heads"],
        OURO_ATTENTION["num_kv_heads"],
        OURO_ATTENTION["head_dim"],
    )
    shape = SimpleNamespace(
        num_hidden_layers=args.layers, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    backends, flash_reason = make_backends(args)
    timer = Timer(device, args.replays, args.warmup)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def randn(*size):
        return torch.randn(size, generator=gen, device=device).to(dtype)

    phases = (
        ("decode", args.batch_sizes, args.context, 1),
        ("prefill", args.prefill_batches, args.prefill_context, args.prefill_len),
    )
    results: dict[tuple, dict] = {}
    with torch.inference_mode():
        # graphs after every eager timing: a failed capture must not disturb those
        for graphs in (False,) if args.no_graphs else (False, True):
            for name, (backend, block_size) in backends.items():
                for phase, sizes, context, q_len in phases:
                    paged = PagedSetup(
                        shape,
                        max_batch=max(sizes),
                        context=context,
                        block_size=block_size,
                        dtype=dtype,
                        device=device,
                        seed=args.seed,
                    )
                    for rows in sizes:
                        if phase == "decode":
                            batch = paged.batch(rows)
                        else:
                            batch = prefill_batch(paged, rows, q_len)
                        n = rows * q_len
                        qkv = (
                            randn(n, heads, head_dim),
                            randn(n, kv_heads, head_dim),
                            randn(n, kv_heads, head_dim),
                        )
                        try:
                            timing = time_call(
                                timer, backend, paged, batch, args.layers, *qkv, graphs
                            )
                        except Exception as exc:  # noqa: BLE001 -- reported, not fatal
                            traceback.print_exc()
                            timing = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                        entry = results.setdefault(
                            (phase, rows, name),
                            dict(
                                phase=phase,
                                batch=rows,
                                backend=name,
                                block_size=block_size,
                                q_len=q_len,
                                context=context,
                            ),
                        )
                        entry.update(timing)
                        mode = "graph" if graphs else "eager"
                        elapsed = time.perf_counter() - started
                        print(
                            f"{phase} batch {rows} {name} ({mode}) at {elapsed:.1f} s", flush=True
                        )
                    del paged
                    if device == "cuda":
                        torch.cuda.empty_cache()
    results = list(results.values())

    for entry in results:
        best = entry.get("graph_us") or entry.get("eager_us")
        if not best:
            continue
        rows, q_len, context = entry["batch"], entry["q_len"], entry["context"]
        if entry["phase"] == "decode":
            kv_bytes = 2 * rows * context * kv_heads * head_dim * torch.finfo(dtype).bits // 8
            entry["kv_gb_per_s"] = kv_bytes / (best * 1e-6) / 1e9
        else:
            flops = causal_flops(rows, q_len, context, heads, head_dim)
            entry["tflop_per_s"] = flops / (best * 1e-6) / 1e12
    out = record(
        "flash_attn_bench",
        args,
        flash_attn=version("flash_attn"),
        flash_attn_unavailable=flash_reason,
        attention=OURO_ATTENTION,
        results=results,
        wall_s=time.perf_counter() - started,
    )
    print_table(out)
    write_json(args.out, out)
    return 0


def print_table(out: dict) -> None:
    if out["flash_attn_unavailable"]:
        print(f"flash_attn not measured: {out['flash_attn_unavailable']}")
    rows = []
    for e in out["results"]:
        rate = ""
        if "kv_gb_per_s" in e:
            rate = f"{e['kv_gb_per_s']:.0f} GB/s"
        elif "tflop_per_s" in e:
            rate = f"{e['tflop_per_s']:.1f} TFLOP/s"
        graph = e.get("graph_us")
        eager = f"{e['eager_us']:.1f}" if "eager_us" in e else e.get("error", "")[:40]
        graph = f"{graph:.1f}" if graph else ("capture failed" if "graph_error" in e else "-")
        rows.append([e["phase"], e["batch"], e["backend"], e["block_size"], eager, graph, rate])
    header = ["phase", "batch", "backend", "block", "eager us", "graph us", "rate"]
    print(markdown_table(header, rows))
    for e in out["results"]:
        if "graph_error" in e:
            print(f"  {e['phase']} {e['batch']} {e['backend']}: graph capture: {e['graph_error']}")


if __name__ == "__main__":
    sys.exit(main())
