"""Multiple-choice accuracy of the bundled model against mean loops per token, through
lm-evaluation-harness against a real `rlt serve` (issue 25, the compute-quality table).

The task (`heldout_cloze`, built here from the repository's held-out passages,
`benchmarks/data/heldout_passages.json`, never trained on): at 4 cut points of each passage
(20/40/60/80% of its words) the context is the passage up to the cut and the choices are 4
continuations of --span words: the true next words and 3 spans from 3 other passages (random
positions), shuffled; deterministic for a --seed. Data and task YAML live in
`benchmarks/data/heldout_cloze/` (`--rebuild-data` writes them again).

One server (`rlt serve`, the bundled model, fp32, CPU, prefix caching on, so each question's
context is computed once across its 4 choices). Settings, one lm-eval run each: full depth
(`local-completions`), then `score_at_exit_depth` at each --thresholds value with min_loops 1
through `rlt-completions` (docs/evaluation.md's subclass), which here also keeps every
response's `prompt_exit_depths`. Per setting: acc and acc_norm, the mean loops of the positions
that score the choices' tokens (`choice_loops`) and of every scored prompt position
(`prompt_loops`), and the server's prefix-cache hits and computed prompt tokens in the run.

    uv run python benchmarks/heldout_cloze.py --out benchmarks/results/heldout_cloze_cpu.json
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import ROOT, parser, record, write_json
from server_process import Server
from workload import heldout_passages

TASK_DIR = ROOT / "benchmarks" / "data" / "heldout_cloze"
DATA = TASK_DIR / "heldout_cloze.jsonl"
CUTS = (0.2, 0.4, 0.6, 0.8)
TASK_YAML = """\
# Cloze multiple choice over the bundled model's held-out passages (benchmarks/heldout_cloze.py
# builds the data; paths are relative to the repository root, where lm-eval runs).
task: heldout_cloze
dataset_path: json
dataset_kwargs:
  data_files: {test: benchmarks/data/heldout_cloze/heldout_cloze.jsonl}
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
"""


def build_items(seed: int, span: int) -> list[dict]:
    texts = heldout_passages()
    words = [text.split() for text in texts]
    rng = random.Random(seed)
    items = []
    for index, passage in enumerate(words):
        others = [i for i in range(len(words)) if i != index]
        for cut in CUTS:
            at = int(len(passage) * cut)
            true = " ".join(passage[at : at + span])
            choices = [true]
            for other in rng.sample(others, 3):
                start = rng.randrange(len(words[other]) - span)
                choices.append(" ".join(words[other][start : start + span]))
            order = list(range(4))
            rng.shuffle(order)
            items.append(
                {
                    "passage": index,
                    "cut": cut,
                    "context": " ".join(passage[:at]),
                    "choices": [choices[i] for i in order],
                    "answer": order.index(0),
                }
            )
    return items


def metrics(base: str) -> dict[str, float]:
    """The server's counters that count prompt work (Prometheus text)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for name in ("prefix_cache_hits", "prefix_cache_queries", "prompt_tokens"):
        match = re.search(rf"^rlt:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def rlt_completions_with_depths(depths: list[tuple[int, list[int]]]) -> str:
    """Registers `rlt-completions-depths`: `rlt-completions` (rlt_lm_eval.py) that also keeps
    (ctxlen, prompt_exit_depths) of every scoring response in `depths`; returns its name."""
    from lm_eval.api.registry import register_model
    from rlt_lm_eval import RltCompletions

    @register_model("rlt-completions-depths")
    class RltCompletionsWithDepths(RltCompletions):
        def parse_logprobs(self, outputs, tokens=None, ctxlens=None, **kwargs):
            for output in outputs if isinstance(outputs, list) else [outputs]:
                for choice, ctxlen in zip(
                    sorted(output["choices"], key=lambda c: c["index"]), ctxlens, strict=False
                ):
                    depths.append((ctxlen, choice["logprobs"]["prompt_exit_depths"]))
            return RltCompletions.parse_logprobs(outputs, tokens, ctxlens, **kwargs)

    return "rlt-completions-depths"


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--thresholds", default="1.0,0.7,0.5,0.3,0.2,0.1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--span", type=int, default=5, help="words per choice")
    p.add_argument("--rebuild-data", action="store_true")
    args = p.parse_args(argv)
    if args.rebuild_data or not DATA.exists():
        TASK_DIR.mkdir(parents=True, exist_ok=True)
        items = build_items(args.seed, args.span)
        DATA.write_text("".join(json.dumps(item) + "\n" for item in items))
        (TASK_DIR / "heldout_cloze.yaml").write_text(TASK_YAML)
    os.chdir(ROOT)
    os.environ |= dict.fromkeys(
        ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"), "1"
    )
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

    from rlt.engine.assembly import DEFAULT_MODEL_DIR

    command = [sys.executable, "-m", "rlt.cli", "serve", "--dtype", "float32", "--device", "cpu"]
    command += ["--enable-prefix-caching", "--served-model-name", "ouro"]
    log = Path(tempfile.mkdtemp(prefix="heldout_cloze-")) / "server.log"
    server = Server(command, log)
    try:
        results = run_settings(args, server.url, str(DEFAULT_MODEL_DIR))
    finally:
        server.stop()
    write_json(args.out, record("heldout_cloze", args, **results))


def run_settings(args, base: str, tokenizer: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    depths: list[tuple[int, list[int]]] = []
    with_depths = rlt_completions_with_depths(depths)
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    config = json.loads((Path(tokenizer) / "config.json").read_text())
    loops = config["total_ut_steps"]
    common = {
        "model": "ouro",
        "base_url": f"{base}/v1/completions",
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "max_length": config["max_position_embeddings"],
        "max_retries": 1,
        "timeout": 120,
    }
    settings = {"full depth": ("local-completions", {})}
    for threshold in args.thresholds.split(","):
        settings[f"threshold {float(threshold)}"] = (
            with_depths,
            {"exit_threshold": float(threshold), "min_loops": 1},
        )
    items = sum(1 for _ in DATA.open())
    results = {
        "task": "heldout_cloze",
        "items": items,
        "choices": 4,
        "seed": args.seed,
        "span_words": args.span,
        "model": "bundled (services/rlt-engine/src/rlt/default_model), fp32, CPU",
        "server": "rlt serve --dtype float32 --device cpu --enable-prefix-caching",
        "lm_eval": lm_eval.__version__,
        "rows": {},
    }
    for name, (model, loop_args) in settings.items():
        depths.clear()
        before = metrics(base)
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=model,
            model_args={**common, **loop_args},
            tasks=["heldout_cloze"],
            task_manager=manager,
            bootstrap_iters=0,
        )
        seconds = time.perf_counter() - start
        after = metrics(base)
        scores = out["results"]["heldout_cloze"]
        choice_depths = [d for ctxlen, ds in depths for d in ds[ctxlen:]]
        prompt_depths = [d for _, ds in depths for d in ds[1:]]
        row = {
            "acc": scores["acc,none"],
            "acc_norm": scores["acc_norm,none"],
            "choice_loops": sum(choice_depths) / len(choice_depths) if depths else loops,
            "prompt_loops": sum(prompt_depths) / len(prompt_depths) if depths else loops,
            "choice_depth_histogram": {
                d: choice_depths.count(d) for d in range(1, loops + 1) if depths
            },
            "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            "prompt_tokens_computed": after["prompt_tokens"] - before["prompt_tokens"],
            "prompt_tokens_queried": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "seconds": round(seconds, 1),
        }
        results["rows"][name] = row
        print(
            f"{name:>15}: acc {row['acc']:.3f} acc_norm {row['acc_norm']:.3f} "
            f"loops/token {row['choice_loops']:.2f} (prompt {row['prompt_loops']:.2f}), "
            f"hits {row['prefix_cache_hit_tokens']:.0f} of {row['prompt_tokens_queried']:.0f} "
            f"tokens, {row['seconds']} s",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
