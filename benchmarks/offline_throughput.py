"""Offline throughput of the rlt engine, several arms measured side by side in one process.

Every arm builds its own engine on the same checkpoint and replays the same seeded workload
(random prompt token ids, fixed output length, ignore_eos, greedy). Arms (repeat --arm):
  fixed            threshold 1.0: every token runs the full depth (families without an exit
                   signal, e.g. Nanbeige4.2: no threshold, which means the same)
  gate             exit_threshold 0.999999, min_loops 2: the exit gate is computed and tested
                   after every loop, yet practically no token exits (random weights); shows the
                   cost of the adaptive path against `fixed`
  threshold:Q      adaptive exit with the model's gate at threshold Q in [0, 1] (min_loops 2)
  trace:P2,P3,P4   depths replayed from a seeded per-token trace with these depth probabilities
                   (the `trace` exit policy); e.g. trace:0.55,0.40,0.05 (mean 2.5, "mix 2.5")
Suffixes (combinable): @no_refill (cohort scheduling), @eager (no CUDA graphs),
@eager_prefill (decode graphs only: prefill_cuda_graphs=False), @sync (async_scheduling=False),
@ticks=N (decode_ticks_per_step=N), @noprofile (skip the --profile-steps window for this arm),
@fp8 (quantization="fp8": fp8 weights of the stack), @kv_fp8 (kv_cache_dtype="fp8");
e.g. fixed@sync, trace:0.55,0.40,0.05@ticks=4, fixed@fp8@kv_fp8.

Per arm (JSON --json-out, "results"; all times host wall clock, time.perf_counter):
  output_tokens_per_s         end to end: output tokens of all requests / wall_s, wall_s from
                              just before the first add_request to the step that finished the
                              last request (plus a device synchronize)
  decode_output_tokens_per_s  decode phase, from engine.core.step_log of the measured run: over
                              applied steps with prefill_tokens == 0, sum(generated) / sum of
                              their durations, a step's duration being its device_s on CUDA
                              (device-clock spacing of consecutive steps' ends, idle included)
                              or else its done_s minus the done_s of the applied step before it
                              (the run's first step has no predecessor and is skipped); null if
                              no such step
  decode_output_tokens, decode_wall_s, decode_steps: the numerator, denominator and step count
  steps, step_ms (wall_s / steps), decode_ticks (loop ticks of all steps of the run),
  host_ms_per_step / readback_wait_ms_per_step (StepTimings.host_s / readback_wait_s deltas
  over the run, per step), mean_loops_per_decoded_token (exit depths of tokens 1.., token 0
  is the prefill's), kv_blocks (memory_plan.num_blocks), max_running (most running requests
  seen after any step), preemptions.
  profile (with --profile-steps N > 0, else null): see profile_decode_window().

--shape picks a random checkpoint (bf16, written once under --checkpoint-dir): tiny,
ouro-1.4b, nanbeige4.2-3b (the Nanbeige4.2-3B release's architecture), tiny-nanbeige,
hrm-text-1b, tiny-hrm-text, dory-4b (the Dory1.0-4B release's architecture), tiny-dory,
huginn-3.5b (the Huginn-0125 release's architecture, 32 steps by default), tiny-huginn.

Examples:
  uv run python benchmarks/offline_throughput.py --shape tiny --arm fixed --arm gate
  python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
      --prompt-len 1024 --output-len 128 --prefill-chunk-size 1024 --num-requests 64 \
      --max-num-seqs 32 --max-num-batched-tokens 2048 --arm fixed --arm trace:0.55,0.40,0.05
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

SHAPES = {
    # name: OuroConfig fields (the ouro-1.4b shape is OuroConfig.ouro_1_4b())
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
NANBEIGE_SHAPES = {
    # name: NanbeigeConfig fields. nanbeige4.2-3b: the release's architecture (22 Llama layers
    # x 2 loops, GQA 48 / 8 heads of 128, rope theta 7e7, 256K positions), random weights
    "nanbeige4.2-3b": dict(
        vocab_size=166144,
        hidden_size=3072,
        intermediate_size=10752,
        num_hidden_layers=22,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_loops=2,
        max_position_embeddings=262144,
        rope_theta=70_000_000.0,
    ),
    "tiny-nanbeige": dict(  # the CPU smoke test of the plumbing
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_loops=2,
        max_position_embeddings=2048,
    ),
}
HRM_TEXT_SHAPES = {
    # name: HrmTextConfig fields. hrm-text-1b: the release's architecture (L and H stacks of 16
    # layers, H_cycles 2 x (L_cycles 3 + 1) stack passes, 12 heads of 128, prefix-LM prompts)
    "hrm-text-1b": dict(
        vocab_size=65536,
        hidden_size=1536,
        intermediate_size=4096,
        num_layers_per_stack=16,
        num_attention_heads=12,
        head_dim=128,
        H_cycles=2,
        L_cycles=3,
        max_position_embeddings=4096,
        embedding_scale=39.19,
    ),
    "tiny-hrm-text": dict(  # the CPU smoke test of the plumbing
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers_per_stack=2,
        num_attention_heads=4,
        head_dim=16,
        H_cycles=2,
        L_cycles=2,
        max_position_embeddings=2048,
        embedding_scale=10.0,
    ),
}
DORY_SHAPES = {
    # name: DoryConfig fields. dory-4b: the release's architecture (`DoryConfig()` defaults:
    # 8 prelude + 20 recurrent + 8 coda nGPT layers, 2 loops, 16 / 4 heads of 256, sliding
    # window 1024 on three layers in four)
    "dory-4b": dict(
        vocab_size=131072,
        hidden_size=2560,
        intermediate_size=7168,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        n_input_layers=8,
        n_recurrent_layers=20,
        n_output_layers=8,
        n_recurrent_loops=2,
        max_position_embeddings=8192,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(36)
        ),
    ),
    "tiny-dory": dict(  # the CPU smoke test of the plumbing
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_input_layers=1,
        n_recurrent_layers=2,
        n_output_layers=1,
        n_recurrent_loops=2,
        max_position_embeddings=2048,
        sliding_window=32,
        layer_types=(
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ),
    ),
}
HUGINN_SHAPES = {
    # name: HuginnConfig fields. huginn-3.5b: the Huginn-0125 release's architecture (2 prelude
    # + 4 recurrent + 2 coda sandwich blocks, 55 heads of 96, mean_recurrence 32: requests run
    # 32 steps by default, the engine's cap is 64)
    "huginn-3.5b": dict(
        vocab_size=65536,
        n_embd=5280,
        n_heads=55,
        n_layers_in_prelude=2,
        n_layers_in_recurrent_block=4,
        n_layers_in_coda=2,
        intermediate_size=17920,
        mean_recurrence=32,
        block_size=4096,
    ),
    "tiny-huginn": dict(  # the CPU smoke test of the plumbing
        vocab_size=512,
        n_embd=64,
        n_heads=4,
        n_layers_in_prelude=1,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=1,
        intermediate_size=128,
        mean_recurrence=4,
        block_size=2048,
        eos_token_id=(0,),
    ),
}
SHAPE_NAMES = (
    *sorted(SHAPES),
    "ouro-1.4b",
    *sorted(NANBEIGE_SHAPES),
    *sorted(HRM_TEXT_SHAPES),
    *sorted(DORY_SHAPES),
    *sorted(HUGINN_SHAPES),
)

WARMUP_TOKENS = 4


def warmup_requests(args) -> int:
    """Warm-up requests per arm (each WARMUP_TOKENS long): as many as the measured run has, so
    its prefill chunks meet decode batches of the sizes the timed run sees and the one-time work
    of each new shape (Triton compilations per specialization, cuBLAS heuristics) is done
    before timing. With fewer (4, then max_num_seqs + 1), the first arms of a c32 process paid
    such costs inside their timed runs: the third arm, same compute as the first, ran 15%
    faster end to end (decode, which excludes prefill steps, was equal). SHARED layouts (whose
    prefill advances position by position) keep max_num_seqs + 1 short prompts."""
    if args.kv_layout == "shared":
        return max(4, min(args.num_requests, args.max_num_seqs + 1))
    return max(4, args.num_requests)


GATE_THRESHOLD = 0.999999
# Substrings (lower case) of kernel names counted as weight GEMMs in the profile summary.
# cuBLAS/CUTLASS kernels, the small-batch Triton GEMVs (rlt_models.small_batch_linear) and the
# batch-invariant Triton GEMM
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "_linear_kernel")


@dataclass
class ArmResult:
    arm: str
    kv_layout: str
    requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    decode_output_tokens: int
    decode_wall_s: float
    decode_output_tokens_per_s: float | None
    decode_steps: int
    mean_loops_per_decoded_token: float
    steps: int
    step_ms: float
    decode_ticks: int
    host_ms_per_step: float
    readback_wait_ms_per_step: float
    kv_blocks: int
    max_running: int
    preemptions: int
    async_scheduling: bool
    decode_ticks_per_step: int
    cuda_graphs_active: bool
    attention_backend: str
    # the small-batch GEMV chosen per "rows bucket x N x K" ("cublas" or the Triton tile):
    # near-ties have gone either way between runs, so each arm records what it ran
    gemv_choices: dict = field(default_factory=dict)
    # CUDA caching-allocator events during the timed run (None off CUDA): `alloc_retries` are
    # allocations that failed, freed the cache and retried (each synchronizes the device);
    # `segment_allocs` new cudaMalloc segments. Both should be 0 after the warm-up.
    allocator: dict | None = field(default=None)
    # prefill graphs (token x chunk-count buckets) captured during the timed run: each capture
    # synchronizes and runs its step eagerly twice; None when prefill runs eagerly
    prefill_graph_captures: int | None = None
    prefill_graph_capture_s: float | None = None  # host seconds those captures took
    profile: dict | None = field(default=None)
    # --keep-step-log: per applied step [prefill tokens, decode ticks, generated tokens,
    # host-clock ms since the run began, device ms (CUDA, else None)]
    step_log: list | None = None


def shape_config(name: str):
    """The model config of a --shape name (any family)."""
    from rlt_models import HrmTextConfig, NanbeigeConfig, OuroConfig
    from rlt_models.dory_config import DoryConfig
    from rlt_models.huginn_config import HuginnConfig

    if name in DORY_SHAPES:
        return DoryConfig(**DORY_SHAPES[name])
    if name in HUGINN_SHAPES:
        return HuginnConfig(**HUGINN_SHAPES[name])
    if name == "ouro-1.4b":
        return OuroConfig.ouro_1_4b()
    if name in NANBEIGE_SHAPES:
        return NanbeigeConfig(**NANBEIGE_SHAPES[name])
    if name in HRM_TEXT_SHAPES:
        return HrmTextConfig(**HRM_TEXT_SHAPES[name])
    return OuroConfig(**SHAPES[name])


def ensure_checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    from rlt_models import RandomInit, write_random_checkpoint
    from rlt_models.families import family_of

    path = Path(args.checkpoint_dir) / args.shape
    if not (path / "config.json").exists():
        config = shape_config(args.shape)
        params = sum(math.prod(shape) for shape in family_of(config).tensor_shapes(config).values())
        device = "cuda" if args.device.startswith("cuda") else "cpu"
        print(f"writing random {args.shape} checkpoint ({params:,} params) to {path}", flush=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_random_checkpoint(
            tmp, config, seed=0, dtype="bfloat16", init=RandomInit(gate_std=0.05), device=device
        )
        tmp.rename(path)  # atomic: a killed writer never leaves a half checkpoint behind
    return path


SUFFIXES = ("no_refill", "eager", "eager_prefill", "sync", "noprofile", "fp8", "kv_fp8")


def parse_arm(spec: str):
    """-> (sampling kwargs, engine kwargs, trace depth probabilities or None, profile?)."""
    name, *flags = spec.split("@")
    engine = {
        "scheduling_mode": "no_refill" if "no_refill" in flags else "refill",
        "cuda_graphs": "eager" not in flags,
        "prefill_cuda_graphs": "eager_prefill" not in flags,
        "async_scheduling": "sync" not in flags,
    }
    if "fp8" in flags:
        engine["quantization"] = "fp8"
    if "kv_fp8" in flags:
        engine["kv_cache_dtype"] = "fp8"
    for flag in flags:
        if flag.startswith("ticks="):
            engine["decode_ticks_per_step"] = int(flag.removeprefix("ticks="))
        elif flag not in SUFFIXES:
            raise SystemExit(f"unknown arm suffix @{flag} in {spec!r}")
    profile = "noprofile" not in flags
    if name == "fixed":
        return {"exit_threshold": 1.0}, engine, None, profile
    if name == "gate":
        return {"exit_threshold": GATE_THRESHOLD, "min_loops": 2}, engine, None, profile
    kind, _, value = name.partition(":")
    if kind == "threshold":
        return {"exit_threshold": float(value), "min_loops": 2}, engine, None, profile
    if kind == "trace":
        probs = [float(x) for x in value.split(",")]
        return {"exit_threshold": 1.0}, {**engine, "exit_policy": "trace"}, probs, profile
    raise SystemExit(f"unknown arm {spec!r}")


def make_workload(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]


def write_trace(path: Path, probs: list[float], args) -> None:
    """Seeded per-request depth lists: token 0 at full depth, then depths 2.. from `probs`
    (bench-i: the measured requests, profile-i: the profile window's, warmup-i: full depth)."""
    rng = random.Random(args.seed + 1)
    depths = list(range(2, 2 + len(probs)))
    trace = {
        f"bench-{i}": [4] + rng.choices(depths, weights=probs, k=args.output_len - 1)
        for i in range(args.num_requests)
    }
    trace.update(
        {
            f"profile-{i}": [4] + rng.choices(depths, weights=probs, k=args.output_len - 1)
            for i in range(args.max_num_seqs)
        }
    )
    trace.update({f"warmup-{i}": [4] * WARMUP_TOKENS for i in range(warmup_requests(args))})
    path.write_text(json.dumps(trace))


def decode_phase(records) -> tuple[int, float, int]:
    """(tokens, seconds, steps) of the steps without prefill work; a step lasts its device_s
    (CUDA) or from the previous applied step's done_s to its own; the first record (no
    predecessor) is skipped. The host clock charges a step with the submission of the step
    after it (e.g. a long eager prefill), so it understates decode throughput next to prefill."""
    tokens, seconds, steps = 0, 0.0, 0
    for before, record in zip(records, records[1:], strict=False):
        if record.prefill_tokens == 0:
            tokens += record.generated
            device_s = getattr(record, "device_s", None)
            seconds += device_s if device_s is not None else record.done_s - before.done_s
            steps += 1
    return tokens, seconds, steps


def run_arm(spec: str, args, model_dir: Path, prompts) -> ArmResult:
    from rlt import LLMEngine, SamplingParams
    from rlt.engine import EngineConfig

    sampling_kwargs, engine_kwargs, trace_probs, profile_arm = parse_arm(spec)
    if trace_probs is not None:
        trace_path = Path(args.checkpoint_dir) / f"trace-{os.getpid()}-{abs(hash(spec))}.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
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
    try:
        if spec.split("@")[0] == "fixed" and engine.model_info().exit_signal == "none":
            # a family without an exit signal runs every token at its depth when no threshold
            # is set, and refuses an explicit one
            sampling_kwargs = {}
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **sampling_kwargs)
        warmup = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, **sampling_kwargs)
        # SHARED prefill runs position by position (one token per row and wave), so short
        # prompts warm it up as well as long ones, and much faster.
        cut = 16 if args.kv_layout == "shared" else args.prompt_len
        for i in range(warmup_requests(args)):  # warm-up: kernels, allocator, autotuning
            engine.add_request(f"warmup-{i}", prompts[i % len(prompts)][:cut], warmup)
        while engine.has_unfinished_requests():
            engine.step()
        _sync(args.device)
        result = _measure(engine, spec, args, prompts, params)
        if args.profile_steps > 0 and profile_arm:
            try:
                result.profile = profile_decode_window(engine, args, prompts, params)
            except Exception as exc:  # the measured numbers stand without it
                traceback.print_exc()
                result.profile = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    finally:
        _shutdown(engine)
        del engine  # the last reference: what the engine held can be freed now
        _free_memory(args.device)
        if trace_probs is not None:
            Path(engine_kwargs["exit_trace"]).unlink(missing_ok=True)  # read at construction


def _prefill_graphs_captured(core) -> tuple[int, float] | None:
    """(graphs captured, host seconds spent capturing) so far; None when prefill is eager."""
    graphs = core.runner.prefill_graphs
    return None if graphs is None else (graphs.captured, graphs.capture_s)


def _measure(engine, spec, args, prompts, params) -> ArmResult:
    core = engine.core
    t = core.timings
    steps0, host0, wait0 = t.steps, t.host_s, t.readback_wait_s
    preempt0 = engine.get_stats().preemptions
    allocator0 = allocator_counts(args.device)
    captured0 = _prefill_graphs_captured(core)
    core.step_log = []
    depths, tokens, max_running = [], 0, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                depths.extend(out.exit_depths[1:])
        max_running = max(max_running, engine.get_stats().running_requests)
    _sync(args.device)
    wall = time.perf_counter() - start
    records, core.step_log = core.step_log, None
    captured1 = _prefill_graphs_captured(core)
    steps = t.steps - steps0
    d_tokens, d_seconds, d_steps = decode_phase(records)
    return ArmResult(
        arm=spec,
        kv_layout=args.kv_layout,
        requests=len(prompts),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tokens_per_s=round(tokens / wall, 1),
        decode_output_tokens=d_tokens,
        decode_wall_s=round(d_seconds, 4),
        decode_output_tokens_per_s=round(d_tokens / d_seconds, 1) if d_seconds > 0 else None,
        decode_steps=d_steps,
        mean_loops_per_decoded_token=round(sum(depths) / max(len(depths), 1), 3),
        steps=steps,
        step_ms=round(1000 * wall / max(steps, 1), 3),
        decode_ticks=sum(r.decode_ticks for r in records),
        host_ms_per_step=round(1000 * (t.host_s - host0) / max(steps, 1), 3),
        readback_wait_ms_per_step=round(1000 * (t.readback_wait_s - wait0) / max(steps, 1), 3),
        kv_blocks=engine.parts.memory_plan.num_blocks,
        max_running=max_running,
        preemptions=engine.get_stats().preemptions - preempt0,
        async_scheduling=core.async_scheduling,
        decode_ticks_per_step=engine.config.decode_ticks_per_step,
        cuda_graphs_active=getattr(core.runner, "graphs", None) is not None,
        attention_backend=engine.parts.attention_backend,
        gemv_choices=gemv_choices(),
        allocator=allocator_delta(allocator0, allocator_counts(args.device)),
        prefill_graph_captures=None if captured0 is None else captured1[0] - captured0[0],
        prefill_graph_capture_s=(
            None if captured0 is None else round(captured1[1] - captured0[1], 3)
        ),
        step_log=[
            [
                r.prefill_tokens,
                r.decode_ticks,
                r.generated,
                round(1000 * (r.done_s - start), 3),
                None if r.device_s is None else round(1000 * r.device_s, 3),
            ]
            for r in records
        ]
        if args.keep_step_log
        else None,
    )


def allocator_counts(device: str) -> dict | None:
    """Cumulative caching-allocator counters of the current CUDA device (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    import torch

    stats = torch.cuda.memory_stats()
    return {
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "segment_allocs": stats.get("segment.all.allocated", 0),
    }


def allocator_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {key: after[key] - before[key] for key in before}


def gemv_choices() -> dict:
    """{"rows x N x K": "cublas" or the Triton tile} of the process's small-batch GEMV
    selections so far, and {"fp8 rows x N x K": kind and tile} of its fp8 ones (empty off
    CUDA)."""
    from rlt_models.fp8_linear import fp8_linear
    from rlt_models.small_batch_linear import small_batch_linear

    def tile(config) -> str:
        return f"{config.block_n}x{config.block_k}/w{config.num_warps}/s{config.num_stages}" + (
            "/row" if config.single_row else ""
        )

    choices = {
        f"{rows}x{n}x{k}": "cublas" if config is None else tile(config)
        for (rows, n, k, *_), config in small_batch_linear.choices.items()
    }
    for (rows, n, k, *_), choice in fp8_linear.choices.items():
        label = choice.kind if choice.tile is None else f"{choice.kind} {tile(choice.tile)}"
        choices[f"fp8 {rows}x{n}x{k}"] = label
    return choices


# -- profile window ------------------------------------------------------------------------------
def profile_decode_window(engine, args, prompts, params) -> dict:
    """Profile `--profile-steps` engine steps of pure decode at full concurrency.

    max_num_seqs requests ("profile-i": the workload's prompts cut to --profile-prompt-len,
    max_tokens = --output-len) are admitted and stepped until every one has its first token
    (prefill done) plus one more step; then the device is synchronized, torch.profiler
    (activities CPU + CUDA; CPU only off CUDA) records N engine.step() calls and a final
    synchronize, and the requests are aborted. The trace is exported as a chrome trace and
    summarized by `summarize_trace` over the window's N submitted steps' decode ticks (from
    step_log). Profiling adds host overhead, so the busy fraction is a lower bound for the
    unprofiled loop.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = args.device.startswith("cuda")
    n = args.max_num_seqs
    plen = min(args.profile_prompt_len or args.prompt_len, args.prompt_len)
    ids = [f"profile-{i}" for i in range(n)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompts[i % len(prompts)][:plen], params)
    started, finished = set(), set()

    def step():
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                finished.add(out.request_id)

    guard = 0
    while len(started | finished) < n and engine.has_unfinished_requests():
        step()
        guard += 1
        if guard > 100_000:
            raise RuntimeError("profile window: prefill never completed")
    step()  # one more: the pipeline now holds a pure decode step
    finished_before = len(finished)
    core = engine.core
    core.step_log = []
    _sync(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        _sync(args.device)
        host_window_s = time.perf_counter() - t0
    step()  # applies the window's last submitted step
    records, core.step_log = core.step_log, None
    for request_id in ids:
        if request_id not in finished:
            engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    # With one step in flight, the window's first step() applied the step submitted before it.
    skip = 1 if core.async_scheduling else 0
    window = records[skip : skip + args.profile_steps]
    ticks = sum(r.decode_ticks for r in window)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    summary = summarize_trace(trace, ticks)
    summary.update(
        steps=args.profile_steps,
        window_steps_found=len(window),
        decode_ticks=ticks,
        prefill_tokens_in_window=sum(r.prefill_tokens for r in window),
        generated_in_window=sum(r.generated for r in window),
        rows=n,
        prompt_len=plen,
        requests_finished_before_window=finished_before,
        requests_finished_in_window=len(finished) - finished_before,
        host_window_ms=round(1000 * host_window_s, 3),
        host_ms_per_step=round(1000 * host_window_s / args.profile_steps, 3),
        torch_version=torch.__version__,
    )
    return summary


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize_trace(trace: dict, ticks: int, top: int = 10) -> dict:
    """Summarize a kineto chrome trace (torch.profiler export_chrome_trace).

    Assumes the kineto format: trace["traceEvents"] holds complete events (ph "X") with ts and
    dur in microseconds; GPU kernels have cat "kernel" (any case), memcpy/memset cat
    "gpu_memcpy"/"gpu_memset"; host API calls cat "cuda_runtime"/"cuda_driver" (graph
    launches named cudaGraphLaunch*/cuGraphLaunch*); kernels and their launch call share
    args["correlation"]. Fields:
      kernel_events_seen: any kernel event at all; graph_launches: graph launch API calls;
      graph_kernels: kernels whose correlation id is a graph launch's (0 with graph_launches >
        0 means graph-replay kernels are missing: the GPU numbers then cover eager kernels only
        and graph_kernels_seen is false);
      kernels: kernel count; kernel_span_ms: first kernel start to last kernel end;
      gpu_busy_fraction: union of kernel intervals / kernel_span (gaps between kernels are idle
        time, whatever their cause);
      kernels_per_loop: kernels / ticks; gpu_ms_per_loop: union of kernel intervals / ticks
        (kernels launched with programmatic dependent launch start while their predecessor
        drains and wait resident, so their durations overlap: a sum would count that twice);
      span_ms_per_loop: kernel_span / ticks (busy plus idle gaps);
      gemm_ms_per_loop: sum of the durations of kernels named like GEMMs (GEMM_MARKERS) / ticks
        (with PDL it includes the time they waited resident for their predecessors);
      memcpy_count / memcpy_ms: memcpy + memset events; top_kernels: the `top` kernels by total
      time (name, count, total_ms). GPU fields are null when no kernel event was seen.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    kernels, copies, graph_corr = [], [], set()
    graph_launches = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat == "kernel":
            kernels.append(ev)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies.append(ev)
        elif cat in ("cuda_runtime", "cuda_driver") and "graphlaunch" in ev.get("name", "").lower():
            graph_launches += 1
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                graph_corr.add(corr)
    graph_kernels = sum(
        1 for k in kernels if (k.get("args") or {}).get("correlation") in graph_corr
    )
    out = {
        "kernel_events_seen": bool(kernels),
        "graph_launches": graph_launches,
        "graph_kernels": graph_kernels,
        "graph_kernels_seen": graph_launches == 0 or graph_kernels > 0,
        "kernels": len(kernels),
        "memcpy_count": len(copies),
        "memcpy_ms": round(sum(float(c.get("dur", 0)) for c in copies) / 1000, 3),
        "kernel_span_ms": None,
        "gpu_busy_fraction": None,
        "kernels_per_loop": None,
        "gpu_ms_per_loop": None,
        "span_ms_per_loop": None,
        "gemm_ms_per_loop": None,
        "top_kernels": [],
    }
    if not kernels:
        return out
    spans = [(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    busy = union_us(spans)
    gemm = sum(
        float(k.get("dur", 0))
        for k in kernels
        if any(m in k.get("name", "").lower() for m in GEMM_MARKERS)
    )
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        entry = by_name.setdefault(k.get("name", "?"), [0, 0.0])
        entry[0] += 1
        entry[1] += float(k.get("dur", 0))
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    out.update(
        kernel_span_ms=round((last - first) / 1000, 3),
        gpu_busy_fraction=round(busy / (last - first), 4) if last > first else None,
        kernels_per_loop=round(len(kernels) / ticks, 2) if ticks else None,
        gpu_ms_per_loop=round(busy / 1000 / ticks, 4) if ticks else None,
        span_ms_per_loop=round((last - first) / 1000 / ticks, 4) if ticks else None,
        gemm_ms_per_loop=round(gemm / 1000 / ticks, 4) if ticks else None,
        top_kernels=[
            {"name": name[:200], "count": count, "total_ms": round(dur / 1000, 3)}
            for name, (count, dur) in ranked
        ],
    )
    return out


# -- helpers -------------------------------------------------------------------------------------
def _shutdown(engine) -> None:
    """LLMEngine.shutdown() (where it exists) releases the engine's GPU memory."""
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _environment(device: str) -> dict:
    import torch

    env = {"torch_version": torch.__version__, "python": sys.version.split()[0]}
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda_version"] = torch.version.cuda
    return env


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def print_table(results: list[ArmResult]) -> None:
    columns = (
        ("e2e tok/s", 10),
        ("dec tok/s", 10),
        ("loops", 6),
        ("steps", 6),
        ("dec st", 6),
        ("step ms", 8),
        ("host ms", 8),
        ("wait ms", 8),
        ("kv blk", 8),
        ("run", 4),
    )
    print(f"{'arm':30}" + "".join(f" {name:>{width}}" for name, width in columns))
    for r in results:
        decode = r.decode_output_tokens_per_s
        print(
            f"{r.arm:30} {r.output_tokens_per_s:10.1f} "
            f"{decode if decode is not None else float('nan'):10.1f} "
            f"{r.mean_loops_per_decoded_token:6.2f} {r.steps:6d} {r.decode_steps:6d} "
            f"{r.step_ms:8.2f} {r.host_ms_per_step:8.2f} {r.readback_wait_ms_per_step:8.2f} "
            f"{r.kv_blocks:8d} {r.max_running:4d}"
        )
    for r in results:
        p = r.profile
        if p is None:
            continue
        if "error" in p:
            print(f"profile {r.arm}: failed: {p['error']}")
            continue
        if p.get("gpu_busy_fraction") is None:
            print(f"profile {r.arm}: no kernel events (kernel_events_seen false)")
            continue
        print(
            f"profile {r.arm}: busy {p['gpu_busy_fraction']:.3f}, "
            f"{p['kernels_per_loop']} kernels/loop, {p['gpu_ms_per_loop']} GPU ms/loop "
            f"(GEMM {p['gemm_ms_per_loop']}), graph kernels seen {p['graph_kernels_seen']}"
        )
    base = results[0]
    for r in results[1:]:
        ratio = r.output_tokens_per_s / base.output_tokens_per_s
        line = f"{r.arm} / {base.arm}: e2e {ratio:.2f}x"
        if r.decode_output_tokens_per_s and base.decode_output_tokens_per_s:
            line += (
                f", decode {r.decode_output_tokens_per_s / base.decode_output_tokens_per_s:.2f}x"
            )
        print(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default: a random --shape checkpoint)"
    )
    parser.add_argument("--shape", default="tiny", choices=SHAPE_NAMES)
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
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each arm's run, profile this many pure-decode steps (0: off)",
    )
    parser.add_argument(
        "--profile-prompt-len",
        type=int,
        default=None,
        help="prompt length of the profile window's requests (default: --prompt-len)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads on the CPU (default: torch's choice); 1 avoids spin-wait "
        "slowdowns on a busy shared host",
    )
    parser.add_argument(
        "--write-checkpoint-only",
        action="store_true",
        help="write the random --shape checkpoint (if missing) and exit",
    )
    parser.add_argument("--json-out", help="write the results (and the setup) as JSON here")
    parser.add_argument(
        "--keep-step-log",
        action="store_true",
        help="keep each arm's per-step log (prefill tokens, ticks, tokens, times) in its result",
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    arms = args.arm or ["fixed", "gate"]
    for arm in arms:
        parse_arm(arm)  # fail fast on a bad spec
    if args.cpu_threads and not args.device.startswith("cuda"):
        import torch

        torch.set_num_threads(args.cpu_threads)
    model_dir = ensure_checkpoint(args)
    if args.write_checkpoint_only:
        print(f"checkpoint ready: {model_dir}", flush=True)
        return 0
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args, vocab)
    results, errors = [], []
    for arm in arms:
        t0 = time.perf_counter()
        try:
            results.append(run_arm(arm, args, model_dir, prompts))
        except Exception as exc:  # report it, free what it held, and go on with the next arm
            traceback.print_exc()
            errors.append({"arm": arm, "error": f"{type(exc).__name__}: {exc}"})
            del exc
            _free_memory(args.device)
            print(f"arm {arm} FAILED after {time.perf_counter() - t0:.1f} s", flush=True)
            continue
        print(f"arm {arm} done in {time.perf_counter() - t0:.1f} s", flush=True)
    if results:
        print_table(results)
    if args.json_out:
        setup = {k: v for k, v in vars(args).items() if k != "json_out"}
        setup.update(_environment(args.device))
        payload = {"setup": setup, "results": [asdict(r) for r in results], "errors": errors}
        Path(args.json_out).write_text(json.dumps(payload, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
