"""Real draft acceptance of the bundled trained model (issue 21), plain vs speculative.

The bundled model (docs/embedded-model.md) continues held-out passages
(`benchmarks/data/heldout_passages.json`: its validation documents, never trained on), one
request at a time (greedy, `--output-len` tokens, prompts of `--prompt-tokens`), at each exit
threshold (`exit_threshold`, min_loops 1): first without speculation, then with every (K
drafts, D draft loops). Per arm (JSON --out): decode tok/s (decode-phase steps, device clock on
CUDA, host clock on the CPU), speedup over the plain arm of the same threshold, the per-draft
acceptance alpha (accepted drafts over drafts reached: whose predecessors were all accepted),
the mean accepted length (tokens a drafting round emits), acceptance by position, mean loops
per decoded token, and whether every request's tokens and exit depths equal the plain arm's.

  uv run python benchmarks/speculative_acceptance.py --out acceptance_cpu.json
  python3 benchmarks/speculative_acceptance.py --device cuda --dtype bfloat16 --out ...
"""

from __future__ import annotations

import json
import sys
import time

from harness import ROOT, floats, ints, parser, record, write_json
from speculative_decoding import acceptance_between
from workload import decode_phase

PASSAGES = ROOT / "benchmarks" / "data" / "heldout_passages.json"


def parse_args(argv=None):
    p = parser(__doc__, device="cpu", dtype="float32")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--thresholds", default="0.5,1.0")
    p.add_argument("--drafts", default="2,4,8")
    p.add_argument("--draft-loops", default="1,2,3")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from rlt import LLMEngine
    from rlt.engine import EngineConfig
    from rlt_models import load_tokenizer

    config = dict(device=args.device, dtype=args.dtype, max_num_seqs=1, prefill_cuda_graphs=False)
    plain = LLMEngine(EngineConfig(**config))
    tokenizer = load_tokenizer(plain.parts.model_dir)
    passages = json.loads(PASSAGES.read_text())["passages"][: args.num_prompts]
    prompts = [tokenizer.encode(p)[: args.prompt_tokens] for p in passages]
    results = record("speculative_acceptance", args, arms=[])
    for threshold in floats(args.thresholds):
        engines = [("plain", {}, plain)]
        for d in ints(args.draft_loops):
            for k in ints(args.drafts):
                options = dict(num_speculative_tokens=k, speculative_draft_loops=d)
                engines.append((f"{k},{d}", options, None))
        reference = base = None
        for name, options, engine in engines:
            engine = engine or LLMEngine(EngineConfig(**config, **options))
            arm, outputs = run(engine, prompts, threshold, args)
            reference, base = reference or outputs, base or arm
            arm.update(arm=name, threshold=threshold, equal_to_plain=outputs == reference)
            arm.update(options)
            arm["speedup"] = round(arm["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
            results["arms"].append(arm)
            print(json.dumps(arm), flush=True)
            write_json(args.out, results)
            if engine is not plain:
                engine.shutdown()
    plain.shutdown()
    return 0


def run(engine, prompts, threshold: float, args) -> tuple[dict, list]:
    from rlt import SamplingParams

    params = SamplingParams(
        max_tokens=args.output_len, exit_threshold=threshold, min_loops=1, ignore_eos=True
    )
    engine.add_request("warmup", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.get_stats()
    tokens = seconds = 0.0
    outputs, depths = [], []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.core.step_log = []
        engine.add_request(f"p{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append((out.token_ids, out.exit_depths))
                    depths.extend(out.exit_depths[1:])
        d_tokens, d_seconds, _ = decode_phase(engine.core.step_log)
        tokens, seconds = tokens + d_tokens, seconds + d_seconds
    engine.core.step_log = None
    wall = time.perf_counter() - start
    arm = dict(
        decode_tokens_per_s=round(tokens / seconds, 1) if seconds else None,
        wall_s=round(wall, 2),
        mean_loops_per_decoded_token=round(sum(depths) / max(len(depths), 1), 3),
        **acceptance_between(before, engine.get_stats()),
    )
    return arm, outputs


if __name__ == "__main__":
    sys.exit(main())
