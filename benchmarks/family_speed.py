"""Decode speed of each model family side by side in one run, against its bandwidth floor
(issue 38, item 6).

    python3 benchmarks/family_speed.py --out DIR                  # on the GPU machine, repo root
    uv run python benchmarks/family_speed.py --out /tmp/f --device cpu \\
        --shapes tiny,tiny-nanbeige,tiny-hrm-text,tiny-dory --quick  # CPU smoke test

Steps, in one process per measurement (a clean CUDA context each):
1. The device's read bandwidth: a 4 GiB bf16 device-to-device copy (bytes read + written over
   its time) and a full fp32-accumulated sum of the same 4 GiB (bytes read over its time),
   each the median of 20 timed runs after 3 warm-ups (CUDA events); the floor uses the larger
   of the two (the stricter floor). Skipped off CUDA (floors are then null).
2. Per --shapes entry (offline_throughput.py's shapes; random weights, bf16, written once
   under --checkpoint-dir): offline_throughput.py with the `fixed` arm (every token at the
   family's full depth), 1,024-token prompts, 128 output tokens, prefill chunk 1,024, LAST_EXITED,
   at each --concurrency C: requests / max-num-seqs / max-num-batched-tokens = 4 / 1 / 1100 for
   C = 1, 2C / C / 64C (at least 2048, at most 4096) otherwise (h200_table.py's rows).
3. With --transformers (the default), per shape whose family the installed transformers has
   (HRM-Text, Dory): transformers' own `generate` on the same
   checkpoint (transformers_generate.py: sdpa, greedy, exactly --output-len new tokens,
   HRM-Text's prompts prefix-LM as rlt runs them), one batch of C requests per
   --transformers-concurrency C (1,32) in one child per shape (generate has no continuous
   batching: C requests at once are one batch of C), its decode tok/s (the prefill excluded,
   as rlt's) and rlt's decode tok/s over it at the same C (--transformers-writer transformers:
   on a checkpoint of transformers' own init instead, written with its `save_pretrained`).
4. Per shape: the bandwidth floor of one request's decode at the family's default depth (the
   runs' requests omit max_loops), bytes per output token = loops x (core weights + core KV
   read per loop at the mean decode context) + prelude and coda weights and KV (once per
   token) + LM head, over the bandwidth; the measured 1-request decode tok/s over that floor;
   at the largest C, "throughput per layer pass" = decode tok/s x layer passes per token
   (loops x core passes + prelude and coda layers); and how many requests of prompt + output
   tokens the memory-sized KV pool holds (kv_blocks / (pages per request x KV planes per
   position: one per loop up to the engine's cap, plus the stage plane)).

Stack weights: every checkpoint tensor but the embedding and the LM head (shape_bytes). The
mean decode context is prompt + output / 2 tokens.

Writes into --out: <shape>-c<C>.json / .log per run (offline_throughput's record and output),
<shape>-transformers.json / .log (the transformers arm), bandwidth.json, families.json
(everything above, the commands, versions (transformers' too) and times) and families.md (the
table, also printed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from harness import ROOT, ints, markdown_table, parser, record, run_logged, version, write_json

BLOCK_SIZE = 16  # the engine's default KV block size
BYTES = 2  # bf16
COPY_GIB = 4
TF_KEYS = ("decode_output_tokens_per_s", "output_tokens_per_s", "prefill_s", "decode_s")
TF_KEYS += ("total_s", "prefix_lm")
RUN_KEYS = ("decode_output_tokens_per_s", "output_tokens_per_s", "mean_loops_per_decoded_token")
RUN_KEYS += ("kv_blocks", "max_running", "preemptions", "decode_steps", "cuda_graphs_active")


def run(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """-> (0 or 1, seconds): the child's outcome (its log says why it failed)."""
    status, seconds = run_logged(cmd, log, timeout_s)
    return (0 if status == "ok" else 1), seconds


# -- 1. bandwidth ----------------------------------------------------------------------------------
BANDWIDTH_SCRIPT = """
import json, sys, torch
gib, out = int(sys.argv[1]), sys.argv[2]
n = gib * 2**30 // 2
src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
dst = torch.empty_like(src)
def median_s(fn, warmup=3, repeats=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return sorted(times)[len(times) // 2]
copy_s = median_s(lambda: dst.copy_(src))
assert torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[-4096:], src[-4096:])
sum_s = median_s(lambda: src.sum(dtype=torch.float32))
nbytes = src.numel() * src.element_size()
json.dump({
    "bytes": nbytes,
    "copy_s": copy_s, "copy_tb_s": 2 * nbytes / copy_s / 1e12,
    "read_sum_s": sum_s, "read_sum_tb_s": nbytes / sum_s / 1e12,
    "device_name": torch.cuda.get_device_name(),
}, open(out, "w"), indent=2)
"""


def measure_bandwidth(out: Path) -> dict | None:
    path = out / "bandwidth.json"
    rc, _ = run(
        [sys.executable, "-c", BANDWIDTH_SCRIPT, str(COPY_GIB), str(path)],
        out / "bandwidth.log",
        120,
    )
    if rc != 0:
        print(f"bandwidth measurement failed (rc {rc}); see bandwidth.log", flush=True)
        return None
    bw = json.loads(path.read_text())
    bw["used_tb_s"] = max(bw["copy_tb_s"], bw["read_sum_tb_s"])
    return bw


# -- 4. floors -------------------------------------------------------------------------------------
def shape_bytes(shape: str, args) -> dict:
    """Bytes one request's decode reads per output token, from the family's tensor list: every
    tensor but the embedding (one row read per token) and the LM head, at 2 bytes each, times
    the stack passes of a loop; KV per loop and context token: layers x 2 x KV heads x
    head_dim x 2 bytes."""
    from rlt_models.families import family_of
    from workload import shape_config

    config = shape_config(shape)
    shapes = family_of(config).tensor_shapes(config)
    head = math.prod(shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])) * BYTES
    stack = sum(
        math.prod(s) * BYTES
        for name, s in shapes.items()
        if name not in ("lm_head.weight", "model.embed_tokens.weight")
    )
    m = config.shape()
    family = config.declaration()
    stages = family.stages
    distinct = stages.core_layers + stages.prelude_layers + stages.coda_layers
    layer_bytes = stack / distinct  # the families' layers of one model have one shape
    # a loop reads each core layer once per stack pass: its KV slots per plane over its
    # distinct layers (1 for Ouro, Nanbeige, Dory and Huginn; 2 for HRM-Text: the L stack 3
    # times, the H stack once); prelude and coda layers (Dory, Huginn) run once per token
    passes = 1 if family.kv.stage_layers else family.kv.layers_per_plane / stages.core_layers
    core_bytes = layer_bytes * stages.core_layers * passes
    stage_bytes = layer_bytes * family.kv.stage_layers
    slot_bytes = 2 * m.num_kv_heads * m.head_dim * BYTES  # K and V of one layer slot
    core_slots = stages.core_layers * passes
    context = args.prompt_len + args.output_len / 2
    loops = family.default_loops  # the runs' requests omit max_loops
    per_token = (
        loops * (core_bytes + core_slots * slot_bytes * context)
        + stage_bytes
        + family.kv.stage_layers * slot_bytes * context
        + head
    )
    return {
        "layers": m.num_layers,
        "loops": loops,
        # layer passes one token makes: its loops' core passes and its prelude and coda layers
        "layer_passes_per_token": round(loops * core_slots + family.kv.stage_layers),
        "kv_planes_per_position": m.num_loops + family.kv.stage_planes,
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "stack_weight_bytes_per_loop": core_bytes,
        "stage_weight_bytes_per_token": stage_bytes,
        "lm_head_bytes": head,
        "kv_bytes_per_context_token_per_loop": core_slots * slot_bytes,
        "mean_decode_context_tokens": context,
        "bytes_per_output_token_c1": round(per_token),
    }


# -- 2. runs ---------------------------------------------------------------------------------------
def row_flags(concurrency: int, quick: bool) -> list[str]:
    if concurrency == 1:
        requests, seqs, tokens = (2 if quick else 4), 1, 1100
    else:
        requests, seqs = (concurrency if quick else 2 * concurrency), concurrency
        tokens = min(4096, max(2048, 64 * concurrency))
    flags = {"--num-requests": requests, "--max-num-seqs": seqs, "--max-num-batched-tokens": tokens}
    return [str(x) for item in flags.items() for x in item]


def bench_command(shape: str, args, program: str = "offline_throughput.py") -> list[str]:
    """A benchmark program on `shape`'s checkpoint (written once under --checkpoint-dir)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / program), "--shape", shape]
    return cmd + ["--checkpoint-dir", args.checkpoint_dir, "--device", args.device]


def measure(shape: str, concurrency: int, args, out: Path) -> dict:
    name = f"{shape}-c{concurrency}"
    path = out / f"{name}.json"
    cmd = [*bench_command(shape, args), "--dtype", args.dtype, "--prefill-chunk-size", "1024"]
    cmd += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    cmd += ["--arm", "fixed", *row_flags(concurrency, args.quick), "--json-out", str(path)]
    rc, elapsed = run(cmd, out / f"{name}.log", args.run_timeout_s)
    record = {"shape": shape, "concurrency": concurrency, "command": cmd[1:], "rc": rc}
    record["elapsed_s"] = elapsed
    if path.exists():
        data = json.loads(path.read_text())
        record |= {"setup": data["args"], "errors": data["errors"]}
        record |= {k: v for k, v in (data["results"] or [{}])[0].items() if k in RUN_KEYS}
    print(
        f"{name}: rc {rc}, {elapsed} s, decode {record.get('decode_output_tokens_per_s')} "
        f"tok/s, e2e {record.get('output_tokens_per_s')}",
        flush=True,
    )
    return record


def summarize(shape: str, runs: list[dict], bw: dict | None, args) -> dict:
    info = shape_bytes(shape, args)
    by_c = {r["concurrency"]: r for r in runs if r.get("decode_output_tokens_per_s")}
    pages = math.ceil((args.prompt_len + args.output_len) / BLOCK_SIZE)
    summary = {"shape": shape, **info}
    if bw is not None:
        floor = bw["used_tb_s"] * 1e12 / info["bytes_per_output_token_c1"]
        summary["floor_tok_s_c1"] = round(floor, 1)
        if 1 in by_c:
            summary["c1_of_floor"] = round(by_c[1]["decode_output_tokens_per_s"] / floor, 3)
    top = max(by_c, default=None)
    if top is not None:
        tok_s = by_c[top]["decode_output_tokens_per_s"]
        summary["per_layer_pass_concurrency"] = top
        summary["layer_passes_per_s"] = round(tok_s * info["layer_passes_per_token"])
        summary["requests_kv_pool_holds"] = by_c[top]["kv_blocks"] // (
            pages * info["kv_planes_per_position"]
        )
        summary["max_running_at_top"] = by_c[top]["max_running"]
    summary["decode_tok_s"] = {c: r["decode_output_tokens_per_s"] for c, r in sorted(by_c.items())}
    summary["e2e_tok_s"] = {c: r["output_tokens_per_s"] for c, r in sorted(by_c.items())}
    return summary


# -- 3. transformers' own generate ----------------------------------------------------------------
def shapes_transformers_has(shapes: list[str]) -> list[str]:
    """The shapes whose family (config.json's model_type) the installed transformers has."""
    from transformers_generate import shape_model_type, transformers_has

    return [shape for shape in shapes if transformers_has(shape_model_type(shape))]


def measure_transformers(shape: str, concurrencies: list[int], args, out: Path) -> list[dict]:
    """One record per concurrency (engine "transformers") from one child that loads the model
    once and times each concurrency as one batch; a concurrency it did not time (out of
    memory, a crash) has no tok/s. Files <shape>-transformers.json / .log."""
    path = out / f"{shape}-transformers.json"
    cmd = bench_command(shape, args, "transformers_generate.py")
    cmd += ["--writer", args.transformers_writer, "--dtype", args.dtype, "--prompt-len"]
    cmd += [str(args.prompt_len), "--output-len", str(args.output_len), "--batch-sizes"]
    cmd += [",".join(map(str, concurrencies)), "--json-out", str(path)]
    rc, elapsed = run(cmd, out / f"{shape}-transformers.log", args.run_timeout_s)
    data = json.loads(path.read_text()) if path.exists() else {}
    by_batch = {r["batch_size"]: r for r in data.get("results", [])}
    errors = {e["batch_size"]: e["error"] for e in data.get("errors", [])}
    records = []
    for c in concurrencies:
        record = {"engine": "transformers", "shape": shape, "concurrency": c, "command": cmd[1:]}
        record |= {"rc": rc, "elapsed_s": elapsed}
        record |= {k: data.get(k) for k in ("transformers", "architecture", "model_dir")}
        if c in by_batch:
            record.update({k: by_batch[c][k] for k in TF_KEYS})
        elif c in errors:
            record["error"] = errors[c]
        records.append(record)
        print(
            f"{shape}-c{c} transformers: rc {rc}, decode "
            f"{record.get('decode_output_tokens_per_s')} tok/s, e2e "
            f"{record.get('output_tokens_per_s')}",
            flush=True,
        )
    return records


def add_to_summary(summary: dict, records: list[dict]) -> None:
    """transformers' decode tok/s per concurrency and rlt's over it, where both ran."""
    tf = {
        r["concurrency"]: r["decode_output_tokens_per_s"]
        for r in records
        if "decode_output_tokens_per_s" in r
    }
    summary["transformers_decode_tok_s"] = dict(sorted(tf.items()))
    rlt = summary.get("decode_tok_s", {})
    summary["rlt_over_transformers_decode"] = {
        c: round(rlt[c] / tok_s, 2) for c, tok_s in sorted(tf.items()) if c in rlt
    }


def table_cells(summary: dict, concurrencies: list[int]) -> list[str]:
    """The transformers columns of one shape's row."""
    if "transformers_decode_tok_s" not in summary:
        return ["n/a", "n/a"]
    tf, ratio = summary["transformers_decode_tok_s"], summary["rlt_over_transformers_decode"]
    return [
        " / ".join(str(tf.get(c, "failed")) for c in concurrencies),
        " / ".join(f"{ratio[c]}x" if c in ratio else "n/a" for c in concurrencies),
    ]


def table(summaries: list[dict], concurrencies: list[int], bw: dict | None, tf_cs: list[int]):
    """tf_cs: the transformers arm's concurrencies ([] for no such columns)."""
    head = ["shape", "layer passes per token", *(f"decode tok/s c{c}" for c in concurrencies)]
    head += ["floor c1 tok/s", "c1 / floor", f"layer passes/s c{max(concurrencies)}"]
    head += ["requests the KV pool holds"]
    if tf_cs:
        cs = " / ".join(f"c{c}" for c in tf_cs)
        head += [f"transformers decode tok/s {cs}", f"rlt / transformers {cs}"]
    rows = []
    for s in summaries:
        cells = [s["shape"], s["layer_passes_per_token"]]
        cells += [s["decode_tok_s"].get(c, "failed") for c in concurrencies]
        passes = s.get("layer_passes_per_s")
        cells += [s.get("floor_tok_s_c1", "n/a"), s.get("c1_of_floor", "n/a")]
        cells += [f"{passes:,}" if passes is not None else "n/a"]
        cells += [s.get("requests_kv_pool_holds", "n/a")]
        rows.append(cells + (table_cells(s, tf_cs) if tf_cs else []))
    lines = [markdown_table(head, rows)]
    if len(summaries) > 1 and all("layer_passes_per_s" in s for s in summaries):
        base = summaries[0]
        for s in summaries[1:]:
            ratio = s["layer_passes_per_s"] / base["layer_passes_per_s"]
            lines.append(f"\n{s['shape']} / {base['shape']} layer passes per second: {ratio:.3f}")
    if bw is not None:
        lines.append(
            f"\nbandwidth: copy {bw['copy_tb_s']:.2f} TB/s (read + write), sum "
            f"{bw['read_sum_tb_s']:.2f} TB/s (read); floors use {bw['used_tb_s']:.2f} TB/s "
            f"({bw['device_name']})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = parser(__doc__, device="cuda", dtype="bfloat16", out=False)
    p.add_argument("--out", required=True, help="the folder of every file")
    p.add_argument("--shapes", default="ouro-1.4b,nanbeige4.2-3b")
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="one wave; tiny shapes: 64 in / 16 out")
    p.add_argument("--run-timeout-s", type=float, default=240)
    p.add_argument(
        "--transformers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="transformers' own generate beside rlt, on the shapes whose family it has",
    )
    p.add_argument("--transformers-concurrency", default="1,32")
    p.add_argument("--transformers-writer", default="rlt", choices=("rlt", "transformers"))
    p.add_argument("--commit", default="", help="the code's commit (default: $RLT_COMMIT, git)")
    args = p.parse_args(argv)
    if args.quick and args.device == "cpu":
        args.prompt_len, args.output_len = 64, 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    concurrencies, tf_concurrencies = ints(args.concurrency), ints(args.transformers_concurrency)
    tf_shapes = shapes_transformers_has(shapes) if args.transformers else []
    expected_runs = len(shapes) * len(concurrencies) + len(tf_shapes) * len(tf_concurrencies)
    t0 = time.perf_counter()
    bw = measure_bandwidth(out) if args.device.startswith("cuda") else None
    if bw is not None:
        print(
            f"bandwidth: copy {bw['copy_tb_s']:.3f} TB/s, sum {bw['read_sum_tb_s']:.3f} TB/s",
            flush=True,
        )
    runs, summaries = [], []
    for shape in shapes:
        write = [*bench_command(shape, args), "--write-checkpoint-only"]
        rc, elapsed = run(write, out / f"{shape}-checkpoint.log", 600)
        print(f"{shape}: checkpoint rc {rc} in {elapsed} s", flush=True)
        shape_runs = [measure(shape, c, args, out) for c in concurrencies] if rc == 0 else []
        summaries.append(summarize(shape, shape_runs, bw, args))
        if shape in tf_shapes:
            tf_runs = measure_transformers(shape, tf_concurrencies, args, out)
            add_to_summary(summaries[-1], tf_runs)
            shape_runs += tf_runs
        runs += shape_runs
    text = table(summaries, concurrencies, bw, tf_concurrencies if tf_shapes else [])
    if args.commit:
        os.environ["RLT_COMMIT"] = args.commit
    payload = record("family_speed", args, transformers=version("transformers"))
    payload |= {"transformers_shapes": tf_shapes, "total_s": round(time.perf_counter() - t0, 1)}
    payload |= {"bandwidth": bw, "summaries": summaries, "runs": runs}
    write_json(out / "families.json", payload)
    (out / "families.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["rc"] == 0 for r in runs) and len(runs) == expected_runs else 1


if __name__ == "__main__":
    sys.exit(main())
