"""What fp8 weights do to the bundled trained model's quality and exit gate (issue 22).

Arms (`--arms`, comma separated): `fp32` / `bf16` (the model in that dtype) and `fp8` /
`fp8-bf16` (fp8 projections, activations and the rest of the weights in fp32 / bf16;
`--quantize-lm-head` quantizes the LM head too); `fp8kv` and `fp8+fp8kv`: the fp8 KV cache
(`kv_cache_dtype="fp8"`, the engine's calibrated per-layer scales) with fp32 / fp8 weights. The
first arm is the reference. Per arm:

  perplexity   teacher-forced at full depth (the Hugging Face forward: every position through
               all T loops, one dense KV cache per loop; with an fp8 KV cache, keys and values
               rounded as the cache stores them) over the held-out passages
               (`benchmarks/data/heldout_passages.json`, never trained on)
  generation   greedy continuations through the engine at each `--thresholds` exit threshold
               (min_loops 1): prompts are `--prompt-tokens`-token windows of the passages,
               `--output-len` tokens each (default 160 x 128 = 20,480 tokens per threshold);
               against the reference arm: the share of sequences identical, the share of
               generated tokens before each sequence's first divergence, and over every
               generated token the mean exit depth and the depth histogram

  uv run python benchmarks/quantization_quality.py --out quality_cpu.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter

from harness import floats, parser, record, write_json
from workload import heldout_passages

ARMS = {  # name: (dtype, quantization, kv_cache_dtype)
    "fp32": ("float32", None, "auto"),
    "bf16": ("bfloat16", None, "auto"),
    "fp8": ("float32", "fp8", "auto"),
    "fp8-bf16": ("bfloat16", "fp8", "auto"),
    "fp8kv": ("float32", None, "fp8"),
    "fp8+fp8kv": ("float32", "fp8", "fp8"),
}


def parse_args(argv=None):
    p = parser(__doc__, device="cpu")
    p.add_argument("--arms", default="fp32,fp8,bf16,fp8-bf16")
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--thresholds", default="0.5,0.7")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--output-len", type=int, default=128)
    return p.parse_args(argv)


def passage_tokens(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in heldout_passages()]


def prompts_from(passages: list[list[int]], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens, round robin over the passages at growing offsets."""
    prompts, offset = [], 0
    while len(prompts) < count:
        for tokens in passages:
            if len(prompts) < count and offset + length <= len(tokens):
                prompts.append(tokens[offset : offset + length])
        offset += length // 2
        if offset > max(len(t) for t in passages):
            offset = 0  # more windows than the passages hold: repeat them
    return prompts


def perplexity(model, passages: list[list[int]], kv_scales=None) -> float:
    """exp(mean NLL) of every next token, each passage through all loops at once.
    `kv_scales` (rlt_runner.KVScales): keys/values go through the fp8 cache's rounding."""
    import torch
    from rlt_attention.kv_store import quantize
    from rlt_models import DenseCausalAttention, DenseKVCache

    class RoundedKV(DenseCausalAttention):
        def __call__(self, layer, query, key, value):
            k, v = (torch.tensor(getattr(kv_scales, w)[layer]) for w in ("key", "value"))
            key = (quantize(key, k).float() * k).to(key.dtype)
            value = (quantize(value, v).float() * v).to(value.dtype)
            return super().__call__(layer, query, key, value)

    attention_type = DenseCausalAttention if kv_scales is None else RoundedKV
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens in passages:
            ids = torch.tensor(tokens, device=model.device)
            positions = torch.arange(len(tokens), device=model.device)
            hidden = model.embed(ids)
            for _ in range(model.shape.num_loops):
                attention = attention_type(DenseKVCache(model.shape.num_layers))
                hidden, _ = model.recurrent_step(hidden, positions, attention, compute_gate=False)
            logprobs = torch.log_softmax(model.coda(hidden).float(), dim=-1)
            nll = -logprobs[:-1].gather(1, ids[1:, None]).sum()
            total, count = total + float(nll), count + len(tokens) - 1
    return math.exp(total / count)


def generate(engine, prompts, threshold: float, output_len: int) -> list[tuple[list, list]]:
    from rlt import SamplingParams

    params = SamplingParams(
        max_tokens=output_len, exit_threshold=threshold, min_loops=1, ignore_eos=True
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{threshold}-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.exit_depths)
    return [done[f"q{threshold}-{i}"] for i in range(len(prompts))]


def compare(outputs, reference) -> dict:
    identical = sum(o[0] == r[0] for o, r in zip(outputs, reference, strict=True))
    agreed = total = 0
    for (tokens, _), (expected, _) in zip(outputs, reference, strict=True):
        total += len(expected)
        agreed += next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b),
            len(expected),
        )
    depths = [d for _, exit_depths in outputs for d in exit_depths[1:]]
    histogram = Counter(depths)
    return dict(
        sequences_identical=round(identical / len(reference), 4),
        tokens_before_divergence=round(agreed / total, 4),
        generated_tokens=sum(len(t) for t, _ in outputs),
        mean_exit_depth=round(sum(depths) / len(depths), 4),
        depth_histogram={str(k): histogram[k] for k in sorted(histogram)},
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from rlt import LLMEngine
    from rlt.engine import EngineConfig
    from rlt_models import load_tokenizer

    results = record("quantization_quality", args, arms=[])
    reference: dict[float, list] = {}
    tokenizer = passages = prompts = None
    for name in args.arms.split(","):
        dtype, quantization, kv_cache_dtype = ARMS[name]
        config = EngineConfig.from_options(
            device=args.device,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            quantize_lm_head=args.quantize_lm_head and quantization is not None,
            max_num_seqs=32,
        )
        engine = LLMEngine(config)
        if tokenizer is None:
            tokenizer = load_tokenizer(engine.parts.model_dir)
            passages = passage_tokens(tokenizer)
            prompts = prompts_from(passages, args.prompt_tokens, args.num_prompts)
        started = time.perf_counter()
        arm = dict(arm=name, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        kv_scales = engine.core.runner.kv.scales
        arm["perplexity"] = round(perplexity(engine.parts.model, passages, kv_scales), 4)
        if kv_scales is not None:
            arm["kv_scales"] = {"key": kv_scales.key, "value": kv_scales.value}
        for threshold in floats(args.thresholds):
            outputs = generate(engine, prompts, threshold, args.output_len)
            reference.setdefault(threshold, outputs)
            arm[f"threshold_{threshold}"] = compare(outputs, reference[threshold])
        arm["wall_s"] = round(time.perf_counter() - started, 1)
        engine.shutdown()
        results["arms"].append(arm)
        print(json.dumps(arm), flush=True)
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
