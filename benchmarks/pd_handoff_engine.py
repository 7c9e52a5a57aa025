"""PD handoff cost inside the engine, on the CPU: how much of P's engine thread a request's KV
handoff takes and how many of P's steps it waits before its writes are done.

Two engines in this process, a prefill (P) and a decode (D) instance, joined by their real NIXL
transports (UCX over host memory), as in tests/test_pd_engine.py: every request goes to D first
(admission: blocks at every plane and a row), D's target goes to P, P prefills and pushes the
KV, D computes token 0. The engines step alternately on this thread (D, then P), so the
numbers are counted in P's steps and P's own time, not in wall time of a concurrent server.

The KV geometry is Ouro-1.4B's (24 layers, 16 KV heads x head_dim 128, 4 loops, layout
last_exited, bf16, block size 16: 768 KiB per prompt token, 384 MiB per 512-token prompt) while
everything else of the random checkpoint is tiny (hidden 64, MLP 128, vocab 512), so that only
the attention over the real heads costs compute (about 4-6 s per 512-token prompt on 2 CPU
cores). Reported:

- per P step: wall time, time in P's PD calls (port.send_chunk + port.poll: planning,
  descriptors, posting NIXL writes, completions), the part of it in `KVTransport.write`
  (descriptor indices and NIXL's posting, which on the CPU includes UCX's memcpy), partitions
  posted, bytes in flight, queue;
- per request: NIXL writes (partitions) and descriptors of its transfer, the P step whose
  results held its last prompt chunk and the P step that reported its writes done
  (`lag_steps`: how many more steps P needed to get the KV out);
- totals: P's PD milliseconds per request, descriptors and partitions per request, the largest
  number of partitions posted in one step.

    uv run python benchmarks/pd_handoff_engine.py                      # 8 x 512 tokens
    uv run python benchmarks/pd_handoff_engine.py --num-requests 4 --prompt-len 512 \\
        --max-inflight-mib 256 --out /tmp/pd_handoff.json

`--max-num-batched-tokens` is P's step budget (default 1024: two 512-token prompts per step);
`--max-inflight-mib` overrides the engine's in-flight bound (default: the engine's own).
About 2-4 minutes for the defaults on 2 cores, most of it attention compute. On the CPU,
`KVTransport.write` includes UCX's memcpy of the bytes (about 230 ms per 384 MiB prompt here),
so the time that is P's own bookkeeping is the PD time minus the writes.

What to look for: `lag_steps` should be 1 for every request (its writes are done at P's next
poll); a lag that grows with the request's position means handoffs queue behind each other (P
posted one in-flight bound per step: 2, 4, 4, 6, ... 10 for 8 requests before the fix), and
descriptors per request far above 2 x layers x planes mean fragmented block tables (6144 for
512 tokens when the KV manager dealt blocks to the planes round-robin, 48 now).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

GEOMETRY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    total_ut_steps=4,
    max_position_embeddings=4096,
)


def ensure_checkpoint(directory: Path) -> Path:
    from rlt_models import OuroConfig, RandomInit, write_random_checkpoint

    path = directory / "pd-kv-geometry"
    if not (path / "config.json").exists():
        write_random_checkpoint(
            path, OuroConfig(**GEOMETRY), seed=0, dtype="bfloat16", init=RandomInit()
        )
    return path


class Meter:
    """Time spent in wrapped methods, per label, reset per step by the caller."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str, on_call=None, on_result=None) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if on_call is not None:
                on_call(*args, **kwargs)
            start = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
            if on_result is not None:
                on_result(result)
            return result

        setattr(obj, name, timed)


def run(args) -> dict:
    from rlt import LLM, SamplingParams
    from rlt_contracts import KVTransferParams, PDRole

    model = ensure_checkpoint(Path(args.checkpoint_dir))
    pages = -(-(args.prompt_len + 1) // 16)
    options = dict(
        dtype="bfloat16",
        device="cpu",
        max_num_seqs=max(args.num_requests, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.max_num_batched_tokens,
        num_kv_blocks=4 * pages * args.num_requests + 8,
    )
    if args.max_inflight_mib is not None:
        options["pd_max_inflight_bytes"] = args.max_inflight_mib << 20
    prefill = LLM(model, pd_role="prefill", **options)
    decode = LLM(model, pd_role="decode", **options)
    p, d = prefill.engine.parts.pd, decode.engine.parts.pd
    p.transport.connect(d.metadata)
    d.transport.connect(p.metadata)
    sender = p.port.sender

    step = 0
    meter = Meter()
    requests: dict[str, dict] = defaultdict(lambda: {"writes": 0, "descriptors": 0})

    def on_chunk(target, tables, start, end, final_row):
        if final_row is not None:
            requests[target.transfer_id]["prompt_done_step"] = step

    def on_write(peer, partition, notification, **_):
        requests[notification.transfer_id]["writes"] += 1
        requests[notification.transfer_id]["descriptors"] += len(partition.descriptors)

    def on_events(events):
        for tid in events.sent:
            requests[tid]["sent_step"] = step

    meter.wrap(p.port, "send_chunk", "pd", on_call=on_chunk)
    meter.wrap(p.port, "poll", "pd", on_result=on_events)
    meter.wrap(p.transport, "write", "write", on_call=on_write)

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(1, 500) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, exit_threshold=1.0)
    for i, prompt in enumerate(prompts):
        params = KVTransferParams(PDRole.DECODE, f"t{i}", prefill_agent=p.agent)
        decode.engine.add_request(f"r{i}", prompt, sampling, kv_transfer=params)
    on_p: set[str] = set()
    finished = 0
    steps = []
    started = time.perf_counter()
    while finished < args.num_requests:
        for out in decode.engine.step() if decode.engine.has_unfinished_requests() else ():
            if out.kv_target is not None and out.request_id not in on_p:
                on_p.add(out.request_id)
                i = int(out.request_id[1:])
                params = KVTransferParams(
                    PDRole.PREFILL, out.kv_target.transfer_id, target=out.kv_target
                )
                prefill.engine.add_request(out.request_id, prompts[i], sampling, params)
            if out.finished:
                if out.error:
                    raise SystemExit(f"{out.request_id} failed: {out.error}")
                finished += 1
        if not prefill.engine.has_unfinished_requests():
            continue
        step += 1
        meter.seconds.clear()
        posted_before = sum(p.transport.posted.values())
        t0 = time.perf_counter()
        prefill.engine.step()
        steps.append(
            {
                "step": step,
                "wall_s": time.perf_counter() - t0,
                "pd_s": meter.seconds["pd"],
                "write_s": meter.seconds["write"],
                "posted": sum(p.transport.posted.values()) - posted_before,
                "inflight_mib": sender.inflight_bytes / 2**20,
                "queued_partitions": sender.queued_partitions,
            }
        )
    wall = time.perf_counter() - started
    for record in requests.values():
        record["lag_steps"] = record["sent_step"] - record["prompt_done_step"]
    rows = [requests[f"t{i}"] for i in range(args.num_requests)]
    pd_total = sum(s["pd_s"] for s in steps)
    write_total = sum(s["write_s"] for s in steps)
    summary = {
        "wall_s": wall,
        "p_steps": len(steps),
        "p_pd_ms_per_request": 1e3 * pd_total / args.num_requests,
        "p_write_ms_per_request": 1e3 * write_total / args.num_requests,
        "writes_per_request": statistics.mean(r["writes"] for r in rows),
        "descriptors_per_request": statistics.mean(r["descriptors"] for r in rows),
        "lag_steps_mean": statistics.mean(r["lag_steps"] for r in rows),
        "lag_steps_max": max(r["lag_steps"] for r in rows),
        "max_posted_per_step": max(s["posted"] for s in steps),
        "max_inflight_bytes": sender.config.max_inflight_bytes,
    }
    prefill.shutdown()
    decode.shutdown()
    return {"config": vars(args), "summary": summary, "steps": steps, "requests": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-inflight-mib", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    result = run(args)
    for s in result["steps"]:
        print(
            f"P step {s['step']:3d}: {s['wall_s']:6.2f} s, PD {1e3 * s['pd_s']:7.1f} ms "
            f"(writes {1e3 * s['write_s']:7.1f} ms), "
            f"posted {s['posted']:3d}, in flight {s['inflight_mib']:6.0f} MiB, "
            f"queued {s['queued_partitions']}"
        )
    for i, r in enumerate(result["requests"]):
        print(
            f"r{i}: {r['writes']} writes, {r['descriptors']} descriptors, prompt done in P step "
            f"{r['prompt_done_step']}, writes done in P step {r['sent_step']} "
            f"(lag {r['lag_steps']})"
        )
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
