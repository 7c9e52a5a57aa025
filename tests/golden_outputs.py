"""The recorded-output fixture of issue 40 ("no behaviour change"): the bundled model's tokens,
exit depths and log-probabilities across KV layouts, scheduling modes, exit policies and
speculation, on the CPU in fp32, as recorded at a commit before the restructuring.

    python tests/golden_outputs.py OUT.json   # record (run it against the commit to pin)

`test_golden_outputs.py` runs the same cases and compares with `fixtures/golden_outputs.json`.
Only the public API is used (`rlt.LLM`, `SamplingParams`), so any commit can record.
"""

from __future__ import annotations

import itertools
import json
import sys

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 11], [64, 128, 9, 31, 77, 18, 200, 201, 45, 16]]
MAX_TOKENS = 8
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=4)
LAYOUTS = ("last_exited", "shared")
MODES = ("refill", "no_refill")
POLICIES = ("hazard", "hazard_delayed", "fixed")


def cases() -> list[dict]:
    """Engine options per case: every layout x mode x policy, then speculation (greedy
    speculation is lossless: its rows must equal plain decoding's)."""
    grid = [
        {"kv_layout": layout, "scheduling_mode": mode, "exit_policy": policy}
        for layout, mode, policy in itertools.product(LAYOUTS, MODES, POLICIES)
    ]
    return grid + [{"num_speculative_tokens": 2, "speculative_draft_loops": 1}]


def case_name(options: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(options.items()))


def record(options: dict) -> list[dict]:
    """One engine with `options`: greedy adaptive requests (fixed depth under the "fixed"
    policy) with top-2 logprobs, one greedy fixed-depth request and one seeded sampled
    request."""
    from rlt import LLM, SamplingParams

    threshold = 1.0 if options.get("exit_policy") == "fixed" else 0.5  # fixed: no signal read
    adaptive = dict(exit_threshold=threshold, ignore_eos=True, logprobs=2, max_tokens=MAX_TOKENS)
    params = [SamplingParams(**adaptive) for _ in PROMPTS]
    params.append(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    params.append(
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=7, top_k=50)
    )
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[2]]
    with LLM(**ENGINE, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {
            "token_ids": list(o.token_ids),
            "exit_depths": list(o.exit_depths),
            "logprobs": None if o.logprobs is None else list(o.logprobs),
            "top_logprobs": None
            if o.top_logprobs is None
            else [list(map(list, t)) for t in o.top_logprobs],
        }
        for o in outputs
    ]


def record_all() -> dict[str, list[dict]]:
    return {case_name(options): record(options) for options in cases()}


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(record_all(), f, indent=1)
