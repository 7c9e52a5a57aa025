"""Self-speculative decoding against plain decoding, side by side in one process (issue 21).

One model is loaded once and shared by every engine (`LLMEngine(config, model=...)`). A
workload is `--concurrency C` requests at once (random prompt ids, `--prompt-len` in,
`--output-len` out, greedy, ignore_eos) at fixed depth (threshold 1.0) or with the 2.5-loop
depth mix (`--mix`: the trace policy replays depths 2/3/4 with probabilities 0.55/0.40/0.05,
as in h200_table.py). Per workload the arms are:

  plain             no speculation (the baseline of the workload's speedups)
  K,D               K drafts from D draft loops, real verification (random weights accept
                    almost nothing: the cost of speculation with no benefit)
  K,D@alpha         the same engine with the benchmarks-only forced acceptance
                    (`SpeculativeProgram.force_acceptance`, never an engine option): the
                    verifier's accepted lengths are replaced by lengths drawn on the host, each
                    draft accepted with probability alpha until the first rejection, so the
                    device does exactly a real round's work at a trained model's acceptance

Per arm (JSON --out, "arms"): decode_output_tokens_per_s (over the steps without prompt work,
each lasting its device-clock spacing, as offline_throughput.py), output_tokens_per_s (end to
end, host clock), spec_mean_accepted_tokens (tokens a drafting round emitted on average:
EngineStats.spec_mean_accepted_length), spec_alpha (the per-draft acceptance: accepted drafts
over drafts reached, i.e. whose predecessors were all accepted), speedup
(decode tok/s over the workload's plain arm), mean loops per decoded token. With `--repeats N`
the arms run N times in turn (plain, K,D, ..., plain, K,D, ...: a drift of the machine hits
every arm alike); decode_output_tokens_per_s is then the median, the runs are listed.

--heldout (the measurement of real acceptance): the bundled model (docs/embedded-model.md)
continues held-out passages (benchmarks/data/heldout_passages.json, never trained on: the first
--num-prompts, cut to --prompt-len tokens: 48 here) one request at a time, greedy (64 tokens
out, D up to 3 unless given), at each --thresholds exit threshold (min_loops 1): plain, then
every (K, D) with real verification; per arm also whether every request's tokens and exit
depths equal the plain arm's.

Example (one H200, Ouro-1.4B shape):
  python3 benchmarks/speculative_decoding.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
      --concurrency 1 --drafts 2,4,8 --draft-loops 1,2 --alphas 0.6,0.8,0.9 --out spec.json
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from harness import floats, free_memory, ints, parser, record, sync, write_json
from offline_throughput import gemv_choices
from workload import MIX, SHAPE_NAMES, decode_phase, ensure_checkpoint, random_prompts

WARMUP_TOKENS = 8


def parse_args(argv=None):
    p = parser(__doc__, device="cpu", dtype="float32")
    p.add_argument("--shape", default="tiny", choices=SHAPE_NAMES)
    p.add_argument("--model", default=None, help="checkpoint (default: a random --shape)")
    p.add_argument("--checkpoint-dir", default="/tmp/rlt-bench-checkpoints")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1", help="comma-separated request counts")
    p.add_argument("--drafts", default="2,4,8", help="K values, comma-separated")
    p.add_argument("--draft-loops", default="1,2", help="D values, comma-separated")
    p.add_argument("--alphas", default="0.6,0.8,0.9", help="forced acceptance rates")
    p.add_argument("--no-real", action="store_true", help="skip the unforced K,D arms")
    p.add_argument("--mix", action="store_true", help="also the 2.5-loop depth mix")
    p.add_argument(
        "--disable-batch-size",
        default="none",
        help="speculative_disable_batch_size of the speculative engines ('none': never pause; "
        "'default': the engine's default)",
    )
    p.add_argument("--step-log", action="store_true", help="per arm: [prompt tokens, tokens, ms]")
    p.add_argument("--decode-ticks-per-step", type=int, default=None, help="default: engine's")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs; the median")
    p.add_argument("--heldout", action="store_true", help="the bundled model's real acceptance")
    p.add_argument("--num-prompts", type=int, default=24, help="--heldout: passages")
    p.add_argument("--thresholds", default="0.5,1.0", help="--heldout: exit thresholds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.heldout:  # its own defaults: 48-token prompts, 64 tokens out, D up to 3
        for name, value in (("prompt_len", 48), ("output_len", 64), ("draft_loops", "1,2,3")):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.heldout:
        return heldout(args)
    from rlt_models import load_model

    path = ensure_checkpoint(args.shape, args.checkpoint_dir, args.device, args.model)
    model = load_model(path, dtype=args.dtype, device=args.device)
    vocab = model.shape.vocab_size
    concurrencies = ints(args.concurrency)
    prompts = random_prompts(args.seed, max(concurrencies), args.prompt_len, vocab)
    trace = Path(args.checkpoint_dir) / f"mix-trace-{args.seed}.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    depths = random.Random(args.seed + 1).choices([2, 3, 4], weights=MIX, k=args.output_len)
    trace.write_text(json.dumps({"*": [model.shape.num_loops, *depths[1:]]}))
    configs = [(k, d) for d in ints(args.draft_loops) for k in ints(args.drafts)]
    alphas = floats(args.alphas)
    results = record("speculative_decoding", args, arms=[])
    started = time.perf_counter()
    for workload in ["fixed", "mix"] if args.mix else ["fixed"]:
        for concurrency in concurrencies:
            run_workload(
                args, model, path, prompts, trace, workload, concurrency, configs, alphas, results
            )
            write_json(args.out, results)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["gemv_choices"] = gemv_choices()
    write_json(args.out, results)
    del model
    free_memory(args.device)
    return 0


def engine_config(args, path: Path, concurrency: int, trace: Path | None, **options):
    """An engine for `concurrency` requests; `trace`: the mix's depths (None: fixed depth)."""
    from rlt.engine import EngineConfig

    steps = args.decode_ticks_per_step
    steps = {} if steps is None else {"decode_ticks_per_step": steps}
    policy = dict(exit_policy="trace", exit_trace=str(trace)) if trace is not None else {}
    return EngineConfig.from_options(
        model=path,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(concurrency, 1),
        max_num_batched_tokens=max(args.prompt_len, 2 * concurrency) + concurrency,
        prefill_chunk_size=args.prompt_len,
        max_model_len=args.prompt_len + args.output_len,
        num_kv_blocks=-(-(args.prompt_len + args.output_len + 16) // 16) * 4 * concurrency + 64,
        prefill_cuda_graphs=False,  # prefill is not what is measured; capture costs time
        **steps,
        **policy,
        **options,
    )


def run_workload(
    args, model, path, prompts, trace, workload, concurrency, configs, alphas, results
) -> None:
    from rlt import LLMEngine

    limit = args.disable_batch_size
    limit = (
        {}
        if limit == "default"
        else {"speculative_disable_batch_size": None if limit == "none" else int(limit)}
    )
    runs = ([] if args.no_real else [None]) + alphas
    arms = [("plain", {}, [None])]
    for k, d in configs:
        options = dict(num_speculative_tokens=k, speculative_draft_loops=d, **limit)
        arms.append((f"{k},{d}", options, runs))
    measured: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # arms alternate, so drifts hit every arm alike
        for name, options, runs in arms:
            mix = trace if workload == "mix" else None
            config = engine_config(args, path, concurrency, mix, **options)
            engine = LLMEngine(config, model=model)
            try:
                warm_up(engine, prompts[:concurrency], args)
                for alpha in runs:
                    program = engine.core.runner.speculation
                    if program is not None:
                        program.force_acceptance(alpha, seed=args.seed)
                    arm = measure(engine, prompts[:concurrency], args)
                    arm.update(
                        workload=workload,
                        concurrency=concurrency,
                        arm=name if alpha is None else f"{name}@{alpha}",
                        num_speculative_tokens=options.get("num_speculative_tokens", 0),
                        speculative_draft_loops=options.get("speculative_draft_loops"),
                        forced_alpha=alpha,
                    )
                    measured.setdefault(arm["arm"], []).append(arm)
                    print(json.dumps(arm), flush=True)
            finally:
                engine.shutdown()
                gc.collect()
    baseline = None
    for label, runs in measured.items():
        arm = dict(runs[-1])
        speeds = [run["decode_output_tokens_per_s"] for run in runs]
        if None not in speeds:
            arm["decode_output_tokens_per_s"] = statistics.median(speeds)
        arm["decode_output_tokens_per_s_runs"] = speeds
        if label == "plain":
            baseline = arm["decode_output_tokens_per_s"]
        arm["speedup"] = (
            round(arm["decode_output_tokens_per_s"] / baseline, 3) if baseline else None
        )
        results["arms"].append(arm)


def warm_up(engine, prompts, args) -> None:
    """Kernels, graphs of the sampling modes used, allocator: the same shapes as measured."""
    from rlt import SamplingParams
    from rlt_contracts import SamplingMode

    program = engine.core.runner.speculation
    graphs = engine.core.runner.speculative_graphs
    params = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True)
    for forced in (None, 0.5) if program is not None else (None,):
        if program is not None:
            program.force_acceptance(forced, seed=args.seed)
        if graphs is not None:  # rows finish one by one: every slot bucket replays
            for gate in (False, True):
                graphs.capture_buckets(SamplingMode(), gate)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"warmup-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    sync(args.device)


def measure(engine, prompts, args) -> dict:
    from rlt import SamplingParams

    core = engine.core
    before = engine.get_stats()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    core.step_log = []
    depths, tokens = [], 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                depths.extend(out.exit_depths[1:])
    sync(args.device)
    wall = time.perf_counter() - start
    records, core.step_log = core.step_log, None
    d_tokens, d_seconds, d_steps = decode_phase(records)
    acceptance = acceptance_between(before, engine.get_stats())
    log = None
    if args.step_log:
        ms = [None if r.device_s is None else round(1e3 * r.device_s, 3) for r in records]
        log = [[r.prefill_tokens, r.generated, t] for r, t in zip(records, ms, strict=True)]
    return dict(
        step_log=log,
        requests=len(prompts),
        output_tokens=tokens,
        output_tokens_per_s=round(tokens / wall, 1),
        decode_output_tokens=d_tokens,
        decode_steps=d_steps,
        decode_output_tokens_per_s=round(d_tokens / d_seconds, 1) if d_seconds else None,
        mean_loops_per_decoded_token=round(sum(depths) / max(len(depths), 1), 3),
        **acceptance,
    )


def acceptance_between(before, after) -> dict:
    """Draft acceptance between two `EngineStats`: spec_mean_accepted_tokens (tokens a drafting
    round emitted), spec_alpha (accepted drafts over drafts reached, i.e. whose predecessors
    were all accepted; rows near max_tokens draft fewer, which this ignores), acceptance by
    position, drafting rounds."""
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    per_position = [
        a - b
        for a, b in zip(
            after.spec_accepted_per_position, before.spec_accepted_per_position, strict=True
        )
    ]
    reached = drafts + sum(per_position[:-1])
    return dict(
        spec_mean_accepted_tokens=round(1 + accepted / drafts, 3) if drafts else None,
        spec_alpha=round(accepted / reached, 3) if reached else None,
        spec_acceptance_by_position=[round(a / drafts, 3) for a in per_position] if drafts else [],
        spec_rounds_with_drafts=drafts,
    )


def heldout(args) -> int:
    """--heldout (module docstring): one request at a time, per threshold and arm."""
    from rlt import LLMEngine, SamplingParams
    from rlt.engine import EngineConfig
    from rlt_models import load_tokenizer
    from workload import heldout_passages

    config = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=1)
    plain = LLMEngine(EngineConfig.from_options(**config, prefill_cuda_graphs=False))
    tokenizer = load_tokenizer(plain.parts.model_dir)
    passages = heldout_passages()[: args.num_prompts]
    prompts = [tokenizer.encode(p)[: args.prompt_len] for p in passages]
    results = record("speculative_decoding", args, arms=[])
    configs = [(k, d) for d in ints(args.draft_loops) for k in ints(args.drafts)]
    for threshold in floats(args.thresholds):
        reference = base = None
        params = SamplingParams(
            max_tokens=args.output_len, exit_threshold=threshold, min_loops=1, ignore_eos=True
        )
        for k, d in [(0, None), *configs]:
            options = dict(num_speculative_tokens=k, speculative_draft_loops=d) if k else {}
            engine = plain
            if k:
                engine = LLMEngine(
                    EngineConfig.from_options(**config, **options, prefill_cuda_graphs=False)
                )
            engine.add_request("warmup", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            before, outputs, depths = engine.get_stats(), [], []
            tokens = seconds = 0.0
            for i, prompt in enumerate(prompts):
                engine.core.step_log = []
                engine.add_request(f"p{i}", prompt, params)
                while engine.has_unfinished_requests():
                    done = [out for out in engine.step() if out.finished]
                    outputs += [(out.token_ids, out.exit_depths) for out in done]
                    depths += [d for out in done for d in out.exit_depths[1:]]
                d_tokens, d_seconds, _ = decode_phase(engine.core.step_log)
                tokens, seconds = tokens + d_tokens, seconds + d_seconds
            engine.core.step_log = None
            arm = dict(arm=f"{k},{d}" if k else "plain", threshold=threshold, **options)
            arm["decode_tokens_per_s"] = round(tokens / seconds, 1) if seconds else None
            arm["mean_loops_per_decoded_token"] = round(sum(depths) / max(len(depths), 1), 3)
            arm |= acceptance_between(before, engine.get_stats())
            reference, base = reference or outputs, base or arm
            arm["equal_to_plain"] = outputs == reference
            arm["speedup"] = round(arm["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
            results["arms"].append(arm)
            print(json.dumps(arm), flush=True)
            write_json(args.out, results)
            if engine is not plain:
                engine.shutdown()
    plain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
