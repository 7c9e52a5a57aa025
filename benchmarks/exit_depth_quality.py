"""The compute-quality curve of early exit on the bundled trained model, through the API's
prompt scoring (issue 25).

Every held-out passage (`benchmarks/data/heldout_passages.json`, never trained on) is scored
by the engine with `prompt_logprobs` at full depth and with `score_at_exit_depth` at each
`--thresholds` exit threshold (min_loops 1): each token's log-probability comes from the loop
where the exit rule fires for its position, exactly as a teacher-forced decode would give it.
Per setting: perplexity over every scored token, and the mean loops per token with the depth
histogram (full depth: every token runs all T loops).

    uv run python benchmarks/exit_depth_quality.py --out exit_depth_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

PASSAGES = Path(__file__).resolve().parent / "data" / "heldout_passages.json"


def score(engine, passages, params) -> tuple[list[float], list[int]]:
    for i, passage in enumerate(passages):
        engine.add_request(f"s{i}", passage, params)
    logprobs, depths = [], []
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    for i in range(len(passages)):
        output = done[f"s{i}"]
        logprobs += output.prompt_logprobs[1:]
        if output.prompt_exit_depths is not None:
            depths += output.prompt_exit_depths[1:]
    return logprobs, depths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9")
    parser.add_argument("--passages", type=int, default=None, help="default: all")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from rlt.engine import EngineConfig, LLMEngine
    from rlt_contracts import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu"))
    tokenizer = engine.tokenizer
    texts = json.loads(PASSAGES.read_text())
    texts = texts["passages"] if isinstance(texts, dict) else texts
    passages = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    passages = passages[: args.passages]
    loops = engine.model_info().num_loops
    settings = {"full depth": SamplingParams(max_tokens=1, prompt_logprobs=0)}
    for threshold in (float(t) for t in args.thresholds.split(",")):
        settings[f"threshold {threshold}"] = SamplingParams(
            max_tokens=1,
            prompt_logprobs=0,
            score_at_exit_depth=True,
            exit_threshold=threshold,
            min_loops=1,
        )
    results = {"model": str(engine.model_info().path), "passages": len(passages), "rows": {}}
    for name, params in settings.items():
        logprobs, depths = score(engine, passages, params)
        depths = depths or [loops] * len(logprobs)
        results["rows"][name] = {
            "tokens": len(logprobs),
            "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "mean_loops_per_token": sum(depths) / len(depths),
            "depth_histogram": dict(sorted(Counter(depths).items())),
        }
        row = results["rows"][name]
        print(
            f"{name:>14}: perplexity {row['perplexity']:.3f}, "
            f"{row['mean_loops_per_token']:.3f} loops/token over {row['tokens']} tokens"
        )
        Path(args.out).write_text(json.dumps(results, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
