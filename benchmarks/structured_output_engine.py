"""What one token per step costs a structured-output request, end to end (bundled model).

Decodes the same number of tokens four ways and reports wall time and tokens per second:
a free request alone, a constrained request alone (a regex that every token can extend, so it
never ends early), and a batch of both (the free request's own finish time shows whether the
constrained neighbour slows it). Device and dtype as given (default: CPU fp32).

    uv run python benchmarks/structured_output_engine.py [--device cuda] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

from rlt import LLM, SamplingParams
from rlt_contracts import StructuredOutput

PROMPT = "It is a truth universally acknowledged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(device=args.device, dtype=args.dtype)
    n = args.tokens
    free = SamplingParams(max_tokens=n, ignore_eos=True)
    spec = StructuredOutput(kind="regex", regex=f"[a-z ]{{{n + 8},}}")
    constrained = SamplingParams(max_tokens=n, ignore_eos=True, structured_output=spec)
    llm.generate([PROMPT], [constrained])  # warm-up: tokenizer, grammar compile, kernels
    cases = {
        "free alone": [free],
        "constrained alone": [constrained],
        "free + constrained": [free, constrained],
    }
    print(f"device {args.device}, {n} tokens per request, best of {args.repeats}")
    print("| case | engine steps | steps until the free request finished | wall s | tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, params in cases.items():
        best = None
        for _ in range(args.repeats):
            engine = llm.engine
            for i, p in enumerate(params):
                engine.add_request(f"{name}-{i}", PROMPT, p)
            start = time.perf_counter()
            steps, free_done, outputs = 0, None, {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        outputs[output.request_id] = output
                        if params[int(output.request_id.rsplit("-", 1)[1])] is free:
                            free_done = steps + 1
                steps += 1
            elapsed = time.perf_counter() - start
            assert all(len(o.token_ids) == n for o in outputs.values())
            best = elapsed if best is None else min(best, elapsed)
        print(
            f"| {name} | {steps} | {free_done if free_done is not None else '-'} | "
            f"{best:.2f} | {n * len(params) / best:.0f} |"
        )


if __name__ == "__main__":
    main()
