"""Decode speed of model families (issue 38 item 6) or of one family's arms (issue 39 item 8:
Huginn) side by side in one run, against the bandwidth floor:

    python3 benchmarks/family_speed.py --out DIR                  # on the GPU machine, repo root
    uv run python benchmarks/family_speed.py --out /tmp/f --device cpu \\
        --shapes tiny,tiny-nanbeige,tiny-hrm-text,tiny-dory --quick  # CPU smoke test

1. Read bandwidth (CUDA only; floors are null off it): a 4 GiB bf16 device-to-device copy
   (bytes read + written over its time) and an fp32-accumulated sum of it (bytes read), each
   the median of 20 runs after 3 warm-ups (CUDA events); floors use the larger (stricter).
2. Per --shapes entry (workload.py's random bf16 checkpoints, written once under
   --checkpoint-dir) and --concurrency point, one offline_throughput.py process (a clean CUDA
   context) with the --arm arms (default `fixed`: the family's full depth; a point's first arm
   is its base), 1,024 in / 128 out, prefill chunk 1,024, plus --engine-args. A point is
   C[/LAYOUT][@SUFFIX...][=ARM+ARM...]: C requests at once, the KV layout (last_exited), arm
   suffixes (e.g. @kv_fp8), its own arms; e.g. 128/ring:8@kv_fp8=fixed+trace:uniform:4-20.
   Requests / max-num-seqs / max-num-batched-tokens: 2W / 1 / 1100 at C = 1, else W x C / C /
   64C (2048 to 4096), W = --waves (2: h200_table.py's rows).
3. --transformers (default), per shape whose family the installed transformers has (HRM-Text,
   Dory): its own `generate` on the same checkpoint (transformers_generate.py: sdpa, greedy,
   --output-len new tokens, HRM-Text's prompts prefix-LM as rlt runs them), one batch per
   --transformers-concurrency C (1,32) in one child per shape; its decode tok/s (prefill
   excluded, as rlt's) and rlt's over it (--transformers-writer transformers: on a checkpoint
   of transformers' own init, written with its `save_pretrained`).
4. Per shape: the floor of one request at the default depth (requests omit max_loops): bytes
   per output token (shape_bytes) = loops x (core weights + per-step tensors outside the
   layers, e.g. Huginn's adapter + core KV at the mean decode context, prompt + output / 2)
   + prelude and coda weights and KV + LM head, over the bandwidth; the base arm's c1 decode
   tok/s over it; at the largest plain C, layer passes per second (decode tok/s x (loops x
   core passes + prelude and coda layers)); per point and arm, decode tok/s over the base's
   and the ideal ratio (the base's layer passes per token over the arm's at its mean loops);
   per layout the pool the engine reports (kv_capacity: bytes per token, full-length requests
   that fit; its requests over last_exited's at the same C and KV dtype: the same memory).

Writes into --out: <shape>-c<C>[-<layout>-<suffix>].json / .log per point, <shape>-transformers
.json / .log, bandwidth.json, families.json (all of it, rewritten after every run: a run cut
short keeps what it measured; plots.py huginn draws it) and families.md (the table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

from harness import ROOT, ints, markdown_table, parser, record, run_logged, version, write_json

BYTES = 2  # bf16
COPY_GIB = 4
TF_KEYS = ("decode_output_tokens_per_s", "output_tokens_per_s", "prefill_s", "decode_s")
TF_KEYS += ("total_s", "prefix_lm")
RUN_KEYS = ("decode_output_tokens_per_s", "output_tokens_per_s", "mean_loops_per_decoded_token")
RUN_KEYS += ("kv_blocks", "max_running", "preemptions", "decode_steps", "cuda_graphs_active")
RUN_KEYS += ("kv_capacity", "kv_cache_dtype", "output_tokens")


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
json.dump({"bytes": nbytes, "copy_s": copy_s, "copy_tb_s": 2 * nbytes / copy_s / 1e12,
    "read_sum_s": sum_s, "read_sum_tb_s": nbytes / sum_s / 1e12,
    "device_name": torch.cuda.get_device_name()}, open(out, "w"), indent=2)
"""


def measure_bandwidth(out: Path) -> dict | None:
    path = out / "bandwidth.json"
    cmd = [sys.executable, "-c", BANDWIDTH_SCRIPT, str(COPY_GIB), str(path)]
    rc, _ = run(cmd, out / "bandwidth.log", 120)
    if rc != 0:
        print(f"bandwidth measurement failed (rc {rc}); see bandwidth.log", flush=True)
        return None
    bw = json.loads(path.read_text())
    bw["used_tb_s"] = max(bw["copy_tb_s"], bw["read_sum_tb_s"])
    print(f"bandwidth: copy {bw['copy_tb_s']:.3f} TB/s, sum {bw['read_sum_tb_s']:.3f} TB/s")
    return bw


# -- 4. floors -------------------------------------------------------------------------------------
def shape_bytes(shape: str, args) -> dict:
    """Bytes one request's decode reads per output token, from the family's tensor list at 2
    bytes each: the layers' tensors (averaged over the distinct layers: one shape per family)
    times the stack passes of a loop, the tensors outside the layers but the embedding (one row
    read per token) and the LM head (the embedding when tied) once per loop; KV per loop and
    context token: layers x 2 x KV heads x head_dim x 2 bytes."""
    from rlt_models.families import family_of
    from workload import shape_config

    config = shape_config(shape)
    shapes = family_of(config).tensor_shapes(config)
    embedding = next(n for n in shapes if n.endswith(("embed_tokens.weight", "wte.weight")))
    head = math.prod(shapes.get("lm_head.weight", shapes[embedding])) * BYTES
    layer_tensors = {n: s for n, s in shapes.items() if re.search(r"\.\d+\.", n)}
    stack = sum(math.prod(s) * BYTES for s in layer_tensors.values())
    per_loop = sum(  # e.g. Huginn's adapter, Ouro's final norm and gate
        math.prod(s) * BYTES
        for n, s in shapes.items()
        if n not in layer_tensors and n not in (embedding, "lm_head.weight")
    )
    m = config.shape()
    family = config.declaration()
    stages = family.stages
    layer_bytes = stack / (stages.core_layers + stages.prelude_layers + stages.coda_layers)
    # a loop reads each core layer once per stack pass: its KV slots per plane over its
    # distinct layers (1 for Ouro, Nanbeige, Dory and Huginn; 2 for HRM-Text: the L stack 3
    # times, the H stack once); prelude and coda layers (Dory, Huginn) run once per token
    passes = 1 if family.kv.stage_layers else family.kv.layers_per_plane / stages.core_layers
    core_bytes = layer_bytes * stages.core_layers * passes + per_loop
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
        # layer passes of one token: loops x core passes per loop + prelude and coda layers
        "core_layer_passes_per_loop": core_slots,
        "stage_layer_passes_per_token": family.kv.stage_layers,
        "layer_passes_per_token": round(loops * core_slots + family.kv.stage_layers),
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "stack_weight_bytes_per_loop": core_bytes,
        "stage_weight_bytes_per_token": stage_bytes,
        "lm_head_bytes": head,
        "kv_bytes_per_context_token_per_loop": core_slots * slot_bytes,
        "mean_decode_context_tokens": context,
        "bytes_per_output_token_c1": round(per_token),
    }


# -- 2. runs ---------------------------------------------------------------------------------------
def parse_point(spec: str, arms: list[str]) -> dict:
    """C[/LAYOUT][@SUFFIX...][=ARM+ARM...] -> label (C itself for a plain C), concurrency,
    layout, the file name's part and the arms it runs (with the suffixes)."""
    spec, _, own = spec.partition("=")
    head, *suffixes = spec.split("@")
    concurrency, _, layout = head.partition("/")
    name = f"c{concurrency}" + (f"-{layout.replace(':', '')}" if layout else "")
    return {
        "label": int(concurrency) if spec == concurrency else spec,
        "concurrency": int(concurrency),
        "layout": layout or "last_exited",
        "name": name + "".join(f"-{x}" for x in suffixes),
        "arms": [a + "".join(f"@{x}" for x in suffixes) for a in own.split("+") if a] or arms,
    }


def row_flags(concurrency: int, waves: int) -> list[str]:
    if concurrency == 1:
        requests, seqs, tokens = 2 * waves, 1, 1100
    else:
        requests, seqs = waves * concurrency, concurrency
        tokens = min(4096, max(2048, 64 * concurrency))
    flags = {"--num-requests": requests, "--max-num-seqs": seqs, "--max-num-batched-tokens": tokens}
    return [str(x) for item in flags.items() for x in item]


def bench_command(shape: str, args, program: str = "offline_throughput.py") -> list[str]:
    """A benchmark program on `shape`'s checkpoint (written once under --checkpoint-dir)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / program), "--shape", shape]
    return cmd + ["--checkpoint-dir", args.checkpoint_dir, "--device", args.device]


def measure(shape: str, point: dict, args, out: Path, timeout_s: float) -> list[dict]:
    """One record per arm of the point (an arm the child did not finish has an error)."""
    name = f"{shape}-{point['name']}"
    path = out / f"{name}.json"
    cmd = [*bench_command(shape, args), "--dtype", args.dtype, "--prefill-chunk-size", "1024"]
    cmd += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    cmd += ["--kv-layout", point["layout"], *row_flags(point["concurrency"], args.waves)]
    arms = point["arms"]
    cmd += [x for arm in arms for x in ("--arm", arm)]
    cmd += [*shlex.split(args.engine_args), "--json-out", str(path)]
    path.unlink(missing_ok=True)  # never report a stale run
    rc, elapsed = run(cmd, out / f"{name}.log", timeout_s)
    base = {"shape": shape, "point": point["label"], "concurrency": point["concurrency"]}
    base |= {"layout": point["layout"], "command": cmd[1:], "rc": rc, "elapsed_s": elapsed}
    data = json.loads(path.read_text()) if path.exists() else {"results": [], "errors": []}
    done = {r["arm"]: {k: r.get(k) for k in RUN_KEYS} for r in data["results"]}
    done |= {e["arm"]: {"error": e["error"]} for e in data["errors"]}
    missing = {"error": f"not measured (rc {rc}; see {name}.log)"}
    records = [base | {"arm": a, "setup": data.get("args")} | done.get(a, missing) for a in arms]
    for r in records:
        print(f"{name} {r['arm']}: rc {rc}, {elapsed} s, decode {r.get(RUN_KEYS[0])} tok/s, "
              f"e2e {r.get(RUN_KEYS[1])}, loops {r.get(RUN_KEYS[2])}", flush=True)  # fmt: skip
    return records


def summarize(shape: str, runs: list[dict], bw: dict | None, args) -> dict:
    info = shape_bytes(shape, args)
    tf = [r for r in runs if r.get("engine") == "transformers"]
    rlt = [r for r in runs if r.get("engine") is None]
    ok = [r for r in rlt if r.get("decode_output_tokens_per_s")]
    first = {}  # point label -> its base arm's record (the point's first arm that ran)
    for r in ok:
        first.setdefault(r["point"], r)
    passes = (info["core_layer_passes_per_loop"], info["stage_layer_passes_per_token"])
    points, kv = [], {}
    for r in ok:
        base, loops = first[r["point"]], r["mean_loops_per_decoded_token"]
        ideal = (base["mean_loops_per_decoded_token"] * passes[0] + passes[1]) / (
            loops * passes[0] + passes[1]
        )
        entry = {k: r[k] for k in ("point", "concurrency", "layout", "arm", "kv_cache_dtype")}
        entry |= {"decode_tok_s": r[RUN_KEYS[0]], "e2e_tok_s": r[RUN_KEYS[1]], "mean_loops": loops}
        entry |= {"over_base": round(r[RUN_KEYS[0]] / base[RUN_KEYS[0]], 3)}
        points.append(entry | {"ideal_over_base": round(ideal, 3)})
        cap, key = r.get("kv_capacity"), (r["layout"], r["kv_cache_dtype"], r["concurrency"])
        if cap:
            kv[key] = {k: entry[k] for k in ("layout", "kv_cache_dtype", "concurrency")} | cap
            kv[key]["pool_gib"] = round(cap["bytes_per_token"] * cap["tokens"] / 2**30, 2)
    for (layout, dtype, c), entry in kv.items():  # what the same memory holds per layout
        plain = kv.get(("last_exited", dtype, c))
        if plain and layout != "last_exited":
            ratio = entry["full_length_requests"] / plain["full_length_requests"]
            entry["requests_over_last_exited"] = round(ratio, 2)
    summary = {"shape": shape, **info, "points": points, "kv": list(kv.values())}
    summary["failed"] = [[r["point"], r["arm"]] for r in rlt if r not in ok]
    summary["decode_tok_s"] = {p: r[RUN_KEYS[0]] for p, r in first.items()}
    summary["e2e_tok_s"] = {p: r[RUN_KEYS[1]] for p, r in first.items()}
    if bw is not None:
        floor = bw["used_tb_s"] * 1e12 / info["bytes_per_output_token_c1"]
        summary["floor_tok_s_c1"] = round(floor, 1)
        if 1 in first:
            summary["c1_of_floor"] = round(first[1][RUN_KEYS[0]] / floor, 3)
    plain = [p for p in first if isinstance(p, int)]
    if plain:
        top = first[max(plain)]
        summary["per_layer_pass_concurrency"] = top["concurrency"]
        summary["layer_passes_per_s"] = round(top[RUN_KEYS[0]] * info["layer_passes_per_token"])
        summary["requests_kv_pool_holds"] = (top["kv_capacity"] or {}).get("full_length_requests")
        summary["max_running_at_top"] = top["max_running"]
    if tf:
        add_to_summary(summary, tf)
    return summary


# -- 3. transformers' own generate ----------------------------------------------------------------
def shapes_transformers_has(shapes: list[str]) -> list[str]:
    """The shapes whose family (config.json's model_type) the installed transformers has."""
    from transformers_generate import shape_model_type, transformers_has

    return [shape for shape in shapes if transformers_has(shape_model_type(shape))]


def measure_transformers(shape: str, concurrencies: list[int], args, out: Path, timeout_s) -> list:
    """One record per concurrency (engine "transformers") from one child that loads the model
    once and times each concurrency as one batch; a concurrency it did not time (out of
    memory, a crash) has no tok/s. Files <shape>-transformers.json / .log."""
    path = out / f"{shape}-transformers.json"
    cmd = bench_command(shape, args, "transformers_generate.py")
    cmd += ["--writer", args.transformers_writer, "--dtype", args.dtype, "--prompt-len"]
    cmd += [str(args.prompt_len), "--output-len", str(args.output_len), "--batch-sizes"]
    cmd += [",".join(map(str, concurrencies)), "--json-out", str(path)]
    rc, elapsed = run(cmd, out / f"{shape}-transformers.log", timeout_s)
    data = json.loads(path.read_text()) if path.exists() else {}
    by_batch = {r["batch_size"]: r for r in data.get("results", [])}
    errors = {e["batch_size"]: e["error"] for e in data.get("errors", [])}
    records = []
    for c in concurrencies:
        record = {"engine": "transformers", "shape": shape, "concurrency": c, "rc": rc}
        record |= {"command": cmd[1:], "elapsed_s": elapsed}
        record |= {k: data.get(k) for k in ("transformers", "architecture", "model_dir")}
        if c in by_batch:
            record.update({k: by_batch[c][k] for k in TF_KEYS})
        elif c in errors:
            record["error"] = errors[c]
        records.append(record)
        print(f"{shape}-c{c} transformers: rc {rc}, decode {record.get(TF_KEYS[0])} tok/s, "
              f"e2e {record.get(TF_KEYS[1])}", flush=True)  # fmt: skip
    return records


def add_to_summary(summary: dict, records: list[dict]) -> None:
    """transformers' decode tok/s per concurrency and rlt's over it, where both ran."""
    tf = dict(sorted((r["concurrency"], r[TF_KEYS[0]]) for r in records if TF_KEYS[0] in r))
    rlt = summary.get("decode_tok_s", {})
    summary["transformers_decode_tok_s"] = tf
    summary["rlt_over_transformers_decode"] = {
        c: round(rlt[c] / tok_s, 2) for c, tok_s in tf.items() if c in rlt
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


def point_cell(e: dict | None, base: bool, failed: bool) -> str:
    if e is None or base:
        return str(e["decode_tok_s"]) if e else "failed" if failed else ""
    ratios = f"{e['over_base']}x, ideal {e['ideal_over_base']}x; {e['mean_loops']} loops"
    return f"{e['decode_tok_s']} ({ratios})"


def table(summaries: list[dict], labels: list, bw: dict | None, tf_cs: list[int]) -> str:
    """One row per shape and arm (an arm's cells: decode tok/s, and past the base arm its ratio
    over the base, the ideal ratio and its mean loops); tf_cs: the transformers arm's
    concurrencies ([] for no such columns)."""
    head = ["shape", "arm", "layer passes per token", *(f"decode tok/s c{c}" for c in labels)]
    head += ["floor c1 tok/s", "c1 / floor", "layer passes/s at the largest plain C"]
    head += ["requests the KV pool holds"]
    if tf_cs:
        cs = " / ".join(f"c{c}" for c in tf_cs)
        head += [f"transformers decode tok/s {cs}", f"rlt / transformers {cs}"]
    rows, lines = [], []
    for s in summaries:
        arms = list(dict.fromkeys(p["arm"].split("@")[0] for p in s["points"])) or ["fixed"]
        for index, arm in enumerate(arms):
            mine = {p["point"]: p for p in s["points"] if p["arm"].split("@")[0] == arm}
            cells = [s["shape"], arm, "" if index else s["layer_passes_per_token"]]
            failed = {(c, a.split("@")[0]) for c, a in s["failed"]}
            cells += [point_cell(mine.get(c), index == 0, (c, arm) in failed) for c in labels]
            if index:
                rows.append(cells + [""] * (len(head) - len(cells)))
                continue
            passes = s.get("layer_passes_per_s")
            cells += [s.get("floor_tok_s_c1", "n/a"), s.get("c1_of_floor", "n/a")]
            cells += [f"{passes:,}" if passes is not None else "n/a"]
            cells += [s.get("requests_kv_pool_holds", "n/a")]
            rows.append(cells + (table_cells(s, tf_cs) if tf_cs else []))
        for k in s["kv"]:
            ratio = k.get("requests_over_last_exited")
            lines.append(
                f"- {s['shape']} KV {k['layout']} ({k['kv_cache_dtype']}, c{k['concurrency']}): "
                f"{k['bytes_per_token']:,} bytes per token, {k['full_length_requests']} requests"
                f" of {k['max_model_len']} tokens fit in the {k['pool_gib']} GiB pool"
                + (f" ({ratio}x last_exited's: the same memory)" if ratio else "")
            )
    lines = [markdown_table(head, rows), ""] + lines
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
    p.add_argument("--shapes", default="ouro-1.4b,nanbeige4.2-3b,hrm-text-1b,dory-4b")
    p.add_argument("--concurrency", default="1,32,128", help="points, comma-separated (above)")
    p.add_argument("--arm", action="append", help="repeatable (offline_throughput's); fixed")
    p.add_argument("--engine-args", default="", help="more offline_throughput.py options")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waves", type=int, default=2, help="requests per point: waves x C")
    p.add_argument("--quick", action="store_true", help="one wave; tiny shapes: 64 in / 16 out")
    p.add_argument("--run-timeout-s", type=float, default=240)
    p.add_argument("--budget-s", type=float, help="no run goes on past this many seconds")
    tf_help = "transformers' own generate beside rlt where it has the family"
    p.add_argument(
        "--transformers", action=argparse.BooleanOptionalAction, default=True, help=tf_help
    )
    p.add_argument("--transformers-concurrency", default="1,32")
    p.add_argument("--transformers-writer", default="rlt", choices=("rlt", "transformers"))
    p.add_argument("--commit", default="", help="the code's commit (default: $RLT_COMMIT, git)")
    args = p.parse_args(argv)
    args.arm = args.arm or ["fixed"]
    if args.quick:
        args.waves = 1
        if args.device == "cpu":
            args.prompt_len, args.output_len = 64, 16
    if args.commit:
        os.environ["RLT_COMMIT"] = args.commit  # the record's and the children's
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    points = [parse_point(x, args.arm) for x in args.concurrency.split(",")]
    tf_concurrencies = ints(args.transformers_concurrency)
    tf_shapes = shapes_transformers_has(shapes) if args.transformers else []
    expected_runs = len(shapes) * sum(len(x["arms"]) for x in points)
    expected_runs += len(tf_shapes) * len(tf_concurrencies)
    t0 = time.perf_counter()

    def left(limit: float) -> float:  # seconds the next run may take
        spent = time.perf_counter() - t0
        return limit if args.budget_s is None else min(limit, args.budget_s - spent)

    bw = measure_bandwidth(out) if args.device.startswith("cuda") else None
    runs = []

    def save() -> str:  # after every run: a run cut short keeps what was measured before it
        summaries = [summarize(s, [r for r in runs if r["shape"] == s], bw, args) for s in shapes]
        labels, tf_cs = [x["label"] for x in points], tf_concurrencies if tf_shapes else []
        text = table(summaries, labels, bw, tf_cs)
        payload = record("family_speed", args, transformers=version("transformers"))
        payload |= {"transformers_shapes": tf_shapes, "total_s": round(time.perf_counter() - t0, 1)}
        payload |= {"bandwidth": bw, "summaries": summaries, "runs": runs}
        write_json(out / "families.json", payload)
        (out / "families.md").write_text(text + "\n")
        return text

    for shape in shapes:
        write = [*bench_command(shape, args), "--write-checkpoint-only"]
        rc, elapsed = run(write, out / f"{shape}-checkpoint.log", max(left(600), 1))
        print(f"{shape}: checkpoint rc {rc} in {elapsed} s", flush=True)
        for point in points if rc == 0 else []:
            if left(args.run_timeout_s) < 30:
                print(f"{shape}-{point['name']}: skipped (--budget-s)", flush=True)
                continue
            runs += measure(shape, point, args, out, left(args.run_timeout_s))
            save()
        if shape in tf_shapes and left(args.run_timeout_s) >= 30:
            timeout = left(args.run_timeout_s)
            runs += measure_transformers(shape, tf_concurrencies, args, out, timeout)
    print(save())
    return 0 if all(r["rc"] == 0 for r in runs) and len(runs) == expected_runs else 1


if __name__ == "__main__":
    sys.exit(main())
