"""family_speed.py's transformers arm: transformers' own `generate` (transformers_generate.py) on
each shape whose family the installed transformers has, in a child process per shape, beside
rlt's runs; its records, summary fields and table columns.

Per such shape, after rlt's runs: one child that loads the model once from the checkpoint
(--transformers-writer rlt: the directory rlt's runs read; transformers: one of transformers'
own init, which the child writes first if missing) and times each of
--transformers-concurrency as a batch of that many requests (generate has no continuous
batching: C requests at once are one batch of C). Files <shape>-transformers.json / .log.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from transformers_generate import shape_model_type, transformers_has

BENCH = Path(__file__).resolve().parent / "transformers_generate.py"
RECORD_KEYS = (
    "decode_output_tokens_per_s",
    "output_tokens_per_s",
    "prefill_s",
    "decode_s",
    "total_s",
    "prefix_lm",
)


def shapes_transformers_has(shapes: list[str]) -> list[str]:
    """The shapes whose family (config.json's model_type) the installed transformers has."""
    return [shape for shape in shapes if transformers_has(shape_model_type(shape))]


def bench_command(shape: str, args) -> list[str]:
    return [
        sys.executable,
        str(BENCH),
        "--shape",
        shape,
        "--checkpoint-dir",
        args.checkpoint_dir,
        "--writer",
        args.transformers_writer,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]


def measure(shape: str, concurrencies: list[int], args, out: Path, run: Callable) -> list[dict]:
    """One record per concurrency (engine "transformers"), each with the child's rc; a
    concurrency the child did not time (out of memory, a crash) has no tok/s."""
    path = out / f"{shape}-transformers.json"
    cmd = [
        *bench_command(shape, args),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--batch-sizes",
        ",".join(map(str, concurrencies)),
        "--json-out",
        str(path),
    ]
    rc, elapsed = run(cmd, out / f"{shape}-transformers.log", args.run_timeout_s)
    data = json.loads(path.read_text()) if path.exists() else {}
    by_batch = {r["batch_size"]: r for r in data.get("results", [])}
    errors = {e["batch_size"]: e["error"] for e in data.get("errors", [])}
    records = []
    for c in concurrencies:
        record = {
            "engine": "transformers",
            "shape": shape,
            "concurrency": c,
            "command": cmd[1:],
            "rc": rc,
            "elapsed_s": elapsed,
            "transformers": data.get("transformers"),
            "architecture": data.get("architecture"),
            "model_dir": data.get("model_dir"),
        }
        if c in by_batch:
            record.update({k: by_batch[c][k] for k in RECORD_KEYS})
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


def table_head(concurrencies: list[int]) -> list[str]:
    cs = " / ".join(f"c{c}" for c in concurrencies)
    return [f"transformers decode tok/s {cs}", f"rlt / transformers {cs}"]


def table_cells(summary: dict, concurrencies: list[int]) -> list[str]:
    if "transformers_decode_tok_s" not in summary:
        return ["n/a", "n/a"]
    tf, ratio = summary["transformers_decode_tok_s"], summary["rlt_over_transformers_decode"]
    return [
        " / ".join(str(tf.get(c, "failed")) for c in concurrencies),
        " / ".join(f"{ratio[c]}x" if c in ratio else "n/a" for c in concurrencies),
    ]
