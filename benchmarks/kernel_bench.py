"""GPU microbenchmark of one Ouro decode loop: fused vs unfused layer ops, paged attention
(Triton split-KV and tiled, flash-attn 2 where importable), programmatic dependent launch (PDL).

Builds an Ouro-shaped model with random weights in memory (no checkpoint) and a paged KV cache
(block size 16, one plane) in which every row is a decode query at the same context, then for
each batch size, per --sections:

  attention  one paged-attention layer call (store + read), split-KV decode kernels vs the
             tiled kernel vs flash-attn 2 (at KV block size 256, which its paged KV needs;
             tools/build_flash_attn.sh builds it), in us per call and GB/s of K/V read (a
             CUDA graph of one call per layer, so consecutive calls read different layers' KV,
             as in a loop; eager where capture fails: flash-attn's adapter declares none);
  prefill    (not by default) the same per --prefill-batches chunks of --prefill-len queries
             ending at --prefill-context: Triton vs flash-attn, causal attention TFLOP/s;
  loop       one recurrent step (all layers + end-of-loop norm + exit gate) captured in a CUDA
             graph, GPU ms per loop from graph replays: fused + split ("fused"), eager layer +
             split ("unfused") and eager layer + tiled kernel ("baseline");
  gemm       the 4 weight GEMMs of every layer alone, in a CUDA graph (the floor of the loop);
  kernels    GPU kernels (and memcpy/memset) of one eager loop of each path (torch.profiler);
  pdl        (CUDA, not by default) the fused loop's graph with the Triton kernels launched
             with PDL and without, and with PDL plus the KV store inside the split kernel
             ("pdl+store_in_split") or store and merge inside it ("pdl+fused_decode"); the
             graphs replay in alternation (--rounds rounds of --pdl-replays each, order
             reversed every round) and the median of each is reported, with whether each
             arm's output is bit-identical to PDL off, and whether the one-row GEMV's PTX holds
             the griddepcontrol instructions.

Times are the median of --replays graph replays, each timed with CUDA events after warm-up.
`--device cpu --tiny` is a smoke mode (a tiny model, torch attention and the torch paths,
wall-clock timing, profiler op counts instead of kernels); it says nothing about speed.

  python benchmarks/kernel_bench.py --out kernel_bench.json          # H200, about a minute
  python benchmarks/kernel_bench.py --sections pdl --batch-sizes 1,2,4,8,16,32,128 --out pdl.json
  uv run python benchmarks/kernel_bench.py --device cpu --tiny        # smoke test, seconds
"""

from __future__ import annotations

import math
import statistics
import sys
import time

from harness import Timer, ints, markdown_table, parser, record, version, write_json
from workload import shape_config

PDL_ARMS = {  # arm: (PDL, TritonPagedAttention options)
    "off": (False, {}),
    "pdl": (True, {}),
    "pdl+store_in_split": (True, {"store_in_split": True}),
    "pdl+fused_decode": (True, {"fused_decode": True}),
}


def parse_args(argv=None):
    p = parser(__doc__, dtype="bfloat16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model instead of Ouro-1.4B")
    p.add_argument("--sections", default="attention,loop,gemm,kernels", help="see above")
    p.add_argument("--batch-sizes", default=None, help="decode rows (default 1,32,128; tiny 1,4)")
    p.add_argument("--context", type=int, default=None, help="of every row (default 1088; tiny 64)")
    p.add_argument("--block-size", type=int, default=16, help="Triton's KV block size")
    p.add_argument("--prefill-len", type=int, default=None, help="prefill: chunk (1024; tiny 40)")
    p.add_argument("--prefill-context", type=int, default=None, help="its end (--prefill-len)")
    p.add_argument("--prefill-batches", default="1,4", help="prefill: chunks per call")
    p.add_argument("--replays", type=int, default=100, help="timed replays (>= 50 advised)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10, help="pdl: alternating rounds")
    p.add_argument("--pdl-replays", type=int, default=10, help="pdl: graph replays per round")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batch_sizes = ints(args.batch_sizes or ("1,4" if args.tiny else "1,32,128"))
    args.context = args.context or (64 if args.tiny else 1088)
    args.prefill_len = args.prefill_len or (40 if args.tiny else 1024)
    args.prefill_context = max(args.prefill_context or 0, args.prefill_len)
    args.prefill_batches = ints(args.prefill_batches)
    args.sections = args.sections.split(",")
    if args.device == "cpu" and args.replays > 20:
        args.replays, args.warmup = (5 if args.tiny else 20), min(args.warmup, 2)
    return args


# -- setup ---------------------------------------------------------------------------------------
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


class PagedSetup:
    """A KV cache for the largest batch and, per batch size, the decode metadata of B rows at
    context `context` (full-width tables, as the runner's decode graphs bind them)."""

    def __init__(self, config, *, max_batch, context, block_size, dtype, device, seed):
        import torch
        from rlt_contracts import KVCacheTensors

        self.context, self.block_size, self.device = context, block_size, device
        self.pages = math.ceil(context / block_size)
        num_blocks = max_batch * self.pages
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        shape = (layers, num_blocks, block_size, heads, config.head_dim)
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        key = torch.empty(shape, dtype=dtype, device=device).normal_(generator=generator)
        value = torch.empty(shape, dtype=dtype, device=device).normal_(generator=generator)
        self.kv = KVCacheTensors(key, value)
        # fragmented, non-monotonic block order
        cpu_gen = torch.Generator().manual_seed(seed + 2)
        self.order = torch.randperm(num_blocks, generator=cpu_gen).to(torch.int32)

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
        return 2 * rows * self.context * key.shape[3] * key.shape[4] * key.element_size()


def count_kernels(fn, device: str) -> dict:
    """GPU kernels and memcpy/memset of one eager call (CPU: top-level aten ops)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    names: dict[str, dict] = {}
    copies = 0
    for event in prof.events():
        if cuda and event.device_type != DeviceType.CUDA:
            continue
        if not cuda and (not event.name.startswith("aten::") or event.cpu_parent is not None):
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


# -- the measurements ----------------------------------------------------------------------------
def attention_backends(device: str, block_size: int) -> tuple[dict, str | None]:
    """name -> (backend, its KV block size); and why flash-attn is not among them."""
    from rlt_attention import TorchPagedAttention, TritonPagedAttention

    if device != "cuda":
        return {"torch": (TorchPagedAttention(), block_size)}, "not on the CPU"
    from rlt_attention import FlashAttnBackend
    from rlt_attention.flash_attn_backend import flash_attn_unavailable_reason

    split, tiled = TritonPagedAttention(), TritonPagedAttention(split_kv=False)
    backends = {"split": (split, block_size), "tiled": (tiled, block_size)}
    reason = flash_attn_unavailable_reason()
    if reason is None:  # its paged KV needs blocks of a multiple of 256 positions
        backends["flash_attn"] = (FlashAttnBackend(), 256)
    return backends, reason


def prefill_batch(paged, rows: int, q_len: int):
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


def loop_paths(device: str) -> dict:
    """name -> (model.fused_path, attention backend name)."""
    if device == "cuda":
        return {
            "fused": ("triton", "split"),
            "unfused": ("off", "split"),
            "baseline": ("off", "tiled"),
        }
    return {"fused": ("torch", "torch"), "unfused": ("off", "torch")}


def bench_attention(model, setups, backends, rows, timer, args, phase="decode") -> list[dict]:
    """One layer call per layer of the cache (store + attend) per backend, in a CUDA graph
    (eagerly where capture fails: flash-attn declares none); us per call and K/V GB/s
    (decode) or causal attention TFLOP/s (prefill)."""
    import torch
    from rlt_attention import split_config

    config, device = model.config, args.device
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q_len = 1 if phase == "decode" else args.prefill_len
    context = args.context if phase == "decode" else args.prefill_context
    gen = torch.Generator(device=device).manual_seed(rows)
    dtype = getattr(torch, args.dtype)
    n = rows * q_len
    query = torch.randn((n, heads, dim), generator=gen, device=device).to(dtype)
    key = torch.randn((n, kv_heads, dim), generator=gen, device=device).to(dtype)
    value = torch.randn((n, kv_heads, dim), generator=gen, device=device).to(dtype)
    layers, results = config.num_hidden_layers, []
    for name, (backend, block_size) in backends.items():
        if phase == "prefill" and name == "tiled":
            continue  # "split" runs prompts with the tiled kernel too
        paged = setups(block_size, context)
        batch = paged.batch(rows) if phase == "decode" else prefill_batch(paged, rows, q_len)
        bound = backend.bind(paged.kv, batch)
        calls = lambda b=bound: [b(i, query, key, value) for i in range(layers)]  # noqa: E731
        entry = {"phase": phase, "batch": rows, "kernel": name, "block_size": block_size}
        try:
            run, _ = timer.capture(calls)
        except Exception as exc:  # noqa: BLE001 -- reported; timed eagerly instead
            entry["graph_error"], run = f"{type(exc).__name__}: {exc}"[:300], calls
        us = entry["us_per_call"] = timer.median_ms(run) * 1e3 / layers
        if phase == "decode":
            entry["kv_gb_per_s"] = paged.kv_bytes_read(rows) / (us * 1e-6) / 1e9
        else:  # QK^T and PV over the keys each query sees (bottom-right causal)
            visible = sum(context - q_len + i + 1 for i in range(q_len))
            entry["tflop_per_s"] = 4.0 * rows * heads * dim * visible / (us * 1e-6) / 1e12
        if name == "split" and phase == "decode":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            entry["num_splits"] = split_config.choose_splits(
                num_groups=rows,
                num_kv_heads=kv_heads,
                max_context_len=paged.pages * paged.block_size,
                queries_per_kv=heads // kv_heads,
                head_dim=dim,
                sm_count=sms,
            ).num_splits
        results.append(entry)
    return results


def decode_inputs(model, paged, rows: int, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(100 + rows)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen, device=device)
    positions = torch.full((rows,), paged.context - 1, dtype=torch.long, device=device)
    return model.embed(tokens), positions, paged.batch(rows)


def bench_loops(model, paged, backends, rows, timer, device) -> tuple[list[dict], list]:
    """Loop timings, and (batch, path, fused_path, loop) to count kernels of once timing is done
    (a profiler session slows what runs after it on some machines)."""
    hidden, positions, batch = decode_inputs(model, paged, rows, device)
    timings, to_count = [], []
    for name, (fused_path, backend_name) in loop_paths(device).items():
        model.fused_path = fused_path
        bound = backends[backend_name][0].bind(paged.kv, batch)

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
    weights = [
        (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for layer in model.layers
    ]
    inputs = (x, attn, x, act)

    def gemms():
        return [F.linear(a, w) for ws in weights for a, w in zip(inputs, ws, strict=True)][-1]

    run, _ = timer.capture(gemms)
    weight_bytes = sum(w.numel() * w.element_size() for ws in weights for w in ws)
    ms = timer.median_ms(run)
    return {"batch": rows, "ms": ms, "weight_gb_per_s": weight_bytes / (ms * 1e-3) / 1e9}


def ptx_has_griddepcontrol() -> bool:
    """Whether a PDL launch of the one-row GEMV compiled the griddepcontrol instructions."""
    import torch
    from rlt_models import small_batch_linear as sbl

    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
    compiled = sbl._single_row_linear_kernel[(32,)](
        x, weight, out, 64, 256, 256, out, BLOCK_N=2, BLOCK_K=256, USE_PDL=True,
        PREDICATED=False, launch_pdl=True,
    )  # fmt: skip
    torch.cuda.synchronize()
    ok = torch.allclose(out.float(), (x.float() @ weight.float().T), rtol=2e-2, atol=2e-2)
    ptx = compiled.asm["ptx"]
    return ok and "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


def bench_pdl(model, paged, rows: int, args) -> dict:
    """The fused loop per PDL arm, replayed in alternation (module docstring)."""
    import torch
    from rlt_attention import TritonPagedAttention
    from rlt_contracts import dependent_launch

    hidden, positions, batch = decode_inputs(model, paged, rows, "cuda")
    timer = Timer("cuda", args.pdl_replays, 0)
    replays, outputs = {}, {}
    model.fused_path = "triton"
    for arm, (pdl, options) in PDL_ARMS.items():
        dependent_launch.set_enabled(pdl)  # the one switch of both kernel packages
        bound = TritonPagedAttention(**options).bind(paged.kv, batch)
        step = lambda b=bound: model.recurrent_step(hidden, positions, b)  # noqa: E731
        replays[arm], outputs[arm] = timer.capture(step)
    dependent_launch.set_enabled(None)
    model.fused_path = "auto"
    times = {arm: [] for arm in PDL_ARMS}
    for index in range(args.rounds + 1):  # round 0 uploads the graphs and warms the clocks
        for arm in list(PDL_ARMS)[:: 1 if index % 2 == 0 else -1]:
            ms = timer.median_ms(replays[arm])
            if index:
                times[arm].append(ms)
    torch.cuda.synchronize()
    median = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "rows": rows,
        "ms_per_loop": {arm: round(value, 4) for arm, value in median.items()},
        "pdl_vs_off": round(median["pdl"] / median["off"], 4),
        "identical_to_off": {
            arm: all(torch.equal(a, b) for a, b in zip(outputs[arm], outputs["off"], strict=True))
            for arm in PDL_ARMS
        },
    }


def print_table(results: dict) -> None:
    decode = [r for r in results["attention"] if r["phase"] == "decode"]
    attention = {(r["batch"], r["kernel"]): r for r in decode}
    loops = {(r["batch"], r["path"]): r["ms_per_loop"] for r in results["loop"]}
    kernels = {(r["batch"], r["path"]): r["kernels"] for r in results["kernels_per_loop"]}
    gemm = {r["batch"]: r["ms"] for r in results["gemm_only"]}
    names = list(dict.fromkeys(k for _, k in attention))
    paths = list(dict.fromkeys(p for _, p in [*loops, *kernels]))
    header = ["batch", *(f"attn {n} us (GB/s)" for n in names)]
    header += [f"loop {p} ms" for p in paths] + ["gemm-only ms"] + [f"kernels {p}" for p in paths]
    rows = []
    for batch in results["args"]["batch_sizes"]:
        row = [batch]
        for n in names:
            a = attention.get((batch, n), {})
            splits = f" s={a['num_splits']}" if "num_splits" in a else ""
            row.append(f"{a['us_per_call']:.1f} ({a['kv_gb_per_s']:.0f}){splits}" if a else "")
        row += [f"{loops[(batch, p)]:.3f}" if (batch, p) in loops else "" for p in paths]
        row += [f"{gemm[batch]:.3f}" if batch in gemm else ""]
        rows.append(row + [kernels.get((batch, p), "") for p in paths])
    print(f"{results['model']}, context {results['args']['context']}, {results['args']['dtype']}")
    print(markdown_table(header, rows))
    for a in results["attention"]:
        if a["phase"] == "prefill":
            rate = f"{a['tflop_per_s']:.1f} TFLOP/s"
            print(f"prefill {a['batch']} x {results['args']['prefill_len']} {a['kernel']}: "
                  f"{a['us_per_call']:.1f} us ({rate})")  # fmt: skip
        if "graph_error" in a:
            print(f"{a['phase']} {a['batch']} {a['kernel']}: timed eagerly, {a['graph_error']}")
    if results["flash_attn_unavailable"]:
        print(f"flash_attn not measured: {results['flash_attn_unavailable']}")
    for entry in results["pdl"]:
        same = entry["identical_to_off"]
        print(f"pdl rows {entry['rows']}: {entry['ms_per_loop']}, same output {same}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device is available (use --device cpu --tiny)")
        return 2
    if "pdl" in args.sections and args.device != "cuda":
        print("--sections pdl needs CUDA")
        return 2
    started = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a smoke test: small CPU thread pools time erratically
    torch.manual_seed(args.seed)
    dtype, device = getattr(torch, args.dtype), args.device
    config = shape_config("tiny" if args.tiny else "ouro-1.4b")
    model = build_random_model(config, dtype, device, args.seed)
    built = {}

    def setups(block_size: int, context: int) -> PagedSetup:
        """One KV cache per (block size, context), for the most rows of a phase."""
        rows = max(args.batch_sizes if context == args.context else args.prefill_batches)
        if (block_size, context) not in built:
            built[(block_size, context)] = PagedSetup(
                config,
                max_batch=rows,
                context=context,
                block_size=block_size,
                dtype=dtype,
                device=device,
                seed=args.seed,
            )
        return built[(block_size, context)]

    paged = setups(args.block_size, args.context)
    timer = Timer(device, args.replays, args.warmup)
    backends, flash_reason = attention_backends(device, args.block_size)
    sections = {k: [] for k in ("attention", "loop", "gemm_only", "kernels_per_loop", "pdl")}
    results = record("kernel_bench", args, model="tiny" if args.tiny else "ouro-1.4b", **sections)
    results |= {"flash_attn": version("flash_attn"), "flash_attn_unavailable": flash_reason}
    results["config"] = {k: v for k, v in vars(config).items() if not isinstance(v, tuple)}
    if "pdl" in args.sections:
        results["ptx_has_griddepcontrol"] = ptx_has_griddepcontrol()
    to_count = []
    with torch.inference_mode():
        for rows in args.batch_sizes:
            if "attention" in args.sections:
                results["attention"] += bench_attention(model, setups, backends, rows, timer, args)
            if "loop" in args.sections or "kernels" in args.sections:
                timings, loops = bench_loops(model, paged, backends, rows, timer, device)
                results["loop"] += timings if "loop" in args.sections else []
                to_count += loops if "kernels" in args.sections else []
            if "gemm" in args.sections:
                results["gemm_only"].append(bench_gemms(model, rows, timer, dtype, device))
            if "pdl" in args.sections:
                results["pdl"].append(bench_pdl(model, paged, rows, args))
            print(f"batch {rows} timed at {time.perf_counter() - started:.1f} s", flush=True)
        for rows in args.prefill_batches if "prefill" in args.sections else []:
            for key in [k for k in built if k[1] != args.prefill_context and built[k] is not paged]:
                del built[key]  # the decode caches other than the loops'
            attention = bench_attention(model, setups, backends, rows, timer, args, "prefill")
            results["attention"] += attention
        for rows, name, fused_path, loop in to_count:
            model.fused_path = fused_path
            results["kernels_per_loop"].append(
                {"batch": rows, "path": name, **count_kernels(loop, device)}
            )
        model.fused_path = "auto"
    results["wall_s"] = time.perf_counter() - started
    print_table(results)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
