"""Offline throughput of the rlt engine, several arms measured side by side in one process.

Every arm replays the same seeded workload (random prompt token ids, fixed output length,
ignore_eos, greedy) on one loaded model and reports output tokens/s, mean loops per decoded
token, and per-step wall, host and device-wait time. Arms (repeat --arm):
  fixed            threshold 1.0: every token runs the full depth
  threshold:Q      adaptive exit with the model's gate at threshold Q (min_loops 2)
  trace:P2,P3,P4   depths replayed from a seeded per-token trace with these depth probabilities
                   (needs the `trace` exit policy); e.g. trace:0.55,0.40,0.05 (mean 2.5)
Append @no_refill to an arm to use that scheduling mode, and @eager to decode without CUDA
graphs, e.g. threshold:0.5@no_refill or fixed@eager.

Examples:
  uv run python benchmarks/offline_throughput.py --shape tiny --arm fixed --arm threshold:0.5
  python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
      --num-requests 256 --prompt-len 512 --output-len 128 --max-num-seqs 64 --arm fixed ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {
    # name: OuroConfig fields
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        total_ut_steps=4,
        max_position_embeddings=2048,
    ),
}


WARMUP_REQUESTS = 4
WARMUP_TOKENS = 4


@dataclass
class ArmResult:
    arm: str
    requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    mean_loops_per_decoded_token: float
    steps: int
    step_ms: float
    host_ms_per_step: float
    readback_wait_ms_per_step: float


def ensure_checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    from rlt_models import OuroConfig, RandomInit, write_random_checkpoint

    path = Path(args.checkpoint_dir) / args.shape
    if not (path / "config.json").exists():
        config = (
            OuroConfig.ouro_1_4b()
            if args.shape == "ouro-1.4b"
            else OuroConfig(**SHAPES[args.shape])
        )
        device = "cuda" if args.device.startswith("cuda") else "cpu"
        print(
            f"writing random {args.shape} checkpoint "
            f"({config.num_parameters():,} params) to {path}",
            flush=True,
        )
        write_random_checkpoint(
            path, config, seed=0, dtype="bfloat16", init=RandomInit(gate_std=0.05), device=device
        )
    return path


def parse_arm(spec: str):
    """-> (sampling kwargs, engine kwargs, trace depth probabilities or None)."""
    name, *flags = spec.split("@")
    engine = {
        "scheduling_mode": "no_refill" if "no_refill" in flags else "refill",
        "cuda_graphs": "eager" not in flags,
    }
    if name == "fixed":
        return {"exit_threshold": 1.0}, engine, None
    kind, _, value = name.partition(":")
    if kind == "threshold":
        return {"exit_threshold": float(value), "min_loops": 2}, engine, None
    if kind == "trace":
        probs = [float(x) for x in value.split(",")]
        return {"exit_threshold": 1.0}, {**engine, "exit_policy": "trace"}, probs
    raise SystemExit(f"unknown arm {spec!r}")


def make_workload(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]


def write_trace(path: Path, probs: list[float], args) -> None:
    """Seeded per-request depth lists: token 0 at full depth, then depths 2.. from `probs`."""
    rng = random.Random(args.seed + 1)
    depths = list(range(2, 2 + len(probs)))
    trace = {
        f"bench-{i}": [4] + rng.choices(depths, weights=probs, k=args.output_len - 1)
        for i in range(args.num_requests)
    }
    trace.update({f"warmup-{i}": [4] * WARMUP_TOKENS for i in range(WARMUP_REQUESTS)})
    path.write_text(json.dumps(trace))


def run_arm(spec: str, args, model_dir: Path, prompts) -> ArmResult:
    from rlt import LLMEngine, SamplingParams
    from rlt.engine import EngineConfig

    sampling_kwargs, engine_kwargs, trace_probs = parse_arm(spec)
    if trace_probs is not None:
        trace_path = Path(args.checkpoint_dir) / f"trace-{abs(hash(spec))}.json"
        write_trace(trace_path, trace_probs, args)
        engine_kwargs["exit_trace"] = str(trace_path)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_layout=args.kv_layout,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=args.prefill_chunk_size,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.prompt_len + args.output_len,
            **engine_kwargs,
        )
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **sampling_kwargs)
    for i in range(WARMUP_REQUESTS):  # warm-up: kernels, allocator, autotuning
        engine.add_request(
            f"warmup-{i}", prompts[i], SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    _sync(args.device)
    timings_before = _copy_timings(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    depths, tokens = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                depths.extend(out.exit_depths[1:])
    _sync(args.device)
    wall = time.perf_counter() - start
    t = engine.core.timings
    steps = t.steps - timings_before["steps"]
    host = t.host_s - timings_before["host_s"]
    wait = t.readback_wait_s - timings_before["readback_wait_s"]
    total = t.total_s - timings_before["total_s"]
    result = ArmResult(
        arm=spec,
        requests=len(prompts),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tokens_per_s=round(tokens / wall, 1),
        mean_loops_per_decoded_token=round(sum(depths) / max(len(depths), 1), 3),
        steps=steps,
        step_ms=round(1000 * total / steps, 3),
        host_ms_per_step=round(1000 * host / steps, 3),
        readback_wait_ms_per_step=round(1000 * wait / steps, 3),
    )
    del engine
    return result


def _copy_timings(engine) -> dict:
    t = engine.core.timings
    return {
        "steps": t.steps,
        "host_s": t.host_s,
        "readback_wait_s": t.readback_wait_s,
        "total_s": t.total_s,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default: a random --shape checkpoint)"
    )
    parser.add_argument("--shape", default="tiny", choices=[*sorted(SHAPES), "ouro-1.4b"])
    parser.add_argument("--checkpoint-dir", default=".runs/bench-checkpoints")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-layout", default="last_exited")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arm", action="append", default=[], help="repeatable; see above")
    parser.add_argument("--json-out", help="write the results (and the setup) as JSON here")
    args = parser.parse_args(argv)
    arms = args.arm or ["fixed", "threshold:0.5"]
    model_dir = ensure_checkpoint(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args, vocab)
    results = [run_arm(arm, args, model_dir, prompts) for arm in arms]
    columns = (
        ("tok/s", 9),
        ("loops", 6),
        ("steps", 6),
        ("step ms", 8),
        ("host ms", 8),
        ("wait ms", 8),
    )
    header = f"{'arm':28}" + "".join(f" {name:>{width}}" for name, width in columns)
    print(header)
    for r in results:
        print(
            f"{r.arm:28} {r.output_tokens_per_s:9.1f} {r.mean_loops_per_decoded_token:6.2f} "
            f"{r.steps:6d} "
            f"{r.step_ms:8.2f} {r.host_ms_per_step:8.2f} {r.readback_wait_ms_per_step:8.2f}"
        )
    base = results[0].output_tokens_per_s
    for r in results[1:]:
        print(f"{r.arm} / {results[0].arm}: {r.output_tokens_per_s / base:.2f}x")
    if args.json_out:
        setup = {k: v for k, v in vars(args).items() if k != "json_out"}
        Path(args.json_out).write_text(
            json.dumps({"setup": setup, "results": [asdict(r) for r in results]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
