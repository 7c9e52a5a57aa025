"""transformers' own `generate` on a looped checkpoint: decode tok/s at given batch sizes, the
baseline beside rlt in benchmarks/family_speed.py (issue 38, item 6).

    python3 benchmarks/transformers_generate.py --shape hrm-text-1b --device cuda \\
        --checkpoint-dir /tmp/rlt-bench-checkpoints --batch-sizes 1,32 --json-out tf.json
    python3 benchmarks/transformers_generate.py --model DIR --device cuda   # any checkpoint dir
    uv run python benchmarks/transformers_generate.py --shape tiny-hrm-text --device cpu \\
        --prompt-len 64 --output-len 16 --batch-sizes 1,4                   # CPU smoke test

The model is whatever `AutoModelForCausalLM.from_pretrained` makes of the directory (config.json's
`model_type`: `hrm_text` -> HrmTextForCausalLM, `dory` -> DoryForCausalLM), in --dtype on
--device with `attn_implementation="sdpa"` and transformers' default (dynamic) cache. Per batch
size B: the first B prompts of offline_throughput.py's seeded workload (--prompt-len random
token ids in [3, vocab), equal lengths, so no padding; attention mask all ones), greedy
decoding (do_sample False, one beam), exactly --output-len new tokens: min_new_tokens =
max_new_tokens = --output-len with no eos token (the output length is checked). One warm-up
`generate` of WARMUP_TOKENS new tokens at the same B, then one timed `generate`.

Timing (host perf_counter; on CUDA with a device synchronize at each mark):
  start_s    just before `generate`
  first_s    the first call of a logits processor appended to generate's own: the prefill's
             forward has produced the logits of token 0 (it synchronizes the device there
             once; later calls only count)
  end_s      after `generate` returned (and a device synchronize)
  decode_output_tokens_per_s = B x (output_len - 1) / (end_s - first_s): the tokens 1.. that
             decode steps produced over the decode time, the prefill excluded, as rlt's
             decode_output_tokens_per_s (offline_throughput.py) counts the tokens of steps
             without prefill work over their duration
  output_tokens_per_s = B x output_len / (end_s - start_s) (end to end), prefill_s = first_s -
             start_s

Prefix-LM (HRM-Text with config.prefix_lm true, the release): rlt prefills the whole prompt as
one bidirectional block; transformers does the same given `token_type_ids` of ones over the
prompt (its first forward then builds a block mask; decode is causal in both), so they are
passed. Other models get no token_type_ids.

Checkpoints (--shape: workload.py's shapes, e.g. hrm-text-1b, dory-4b; --writer):
  rlt           (the default) workload.py's random checkpoint of the shape (rlt's
                `write_random_checkpoint`, the Hub layout transformers loads) under
                --checkpoint-dir/<shape>: the same directory the rlt runs read, so one
                checkpoint serves both engines
  transformers  transformers' own random init of the same config.json (`from_config`, seeded,
                built on --device in --dtype), written with `save_pretrained` under
                --checkpoint-dir/transformers/<shape> (for a family rlt writes no checkpoint
                of, or to time transformers on its own init)
--model DIR skips both and reads any checkpoint directory transformers has a causal LM for (a
Hub download, e.g.). --write-checkpoint-only writes and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import ints, parser, record, sync, write_json
from workload import SHAPE_NAMES, ensure_checkpoint, random_prompts, shape_config

WARMUP_TOKENS = 4
WRITERS = ("rlt", "transformers")


class BenchmarkInputError(ValueError):
    """A shape, writer or checkpoint this benchmark cannot run, named in the message."""


@dataclass
class GenerateTiming:
    batch_size: int
    prompt_len: int
    output_len: int
    prefill_s: float
    decode_s: float
    total_s: float
    decode_output_tokens_per_s: float
    output_tokens_per_s: float
    prefix_lm: bool


def shape_config_json(shape: str) -> dict:
    """The config.json contents of a --shape's checkpoint (workload.py's shapes)."""
    if shape not in SHAPE_NAMES:
        raise BenchmarkInputError(f"unknown shape {shape!r}; known: {sorted(SHAPE_NAMES)}")
    return shape_config(shape).to_dict()


def shape_model_type(shape: str) -> str:
    return shape_config_json(shape)["model_type"]


def transformers_has(model_type: str) -> bool:
    """Whether the installed transformers has a causal LM for `model_type`."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def checkpoint_path(shape: str, checkpoint_dir: str | Path, writer: str) -> Path:
    """Where the checkpoint of `shape` lives for `writer` ("rlt" or "transformers")."""
    if writer not in WRITERS:
        raise BenchmarkInputError(f"writer must be one of {WRITERS}, got {writer!r}")
    base = Path(checkpoint_dir)
    return base / shape if writer == "rlt" else base / "transformers" / shape


def ensure_transformers_checkpoint(
    shape: str, checkpoint_dir: str | Path, *, device: str, dtype: str, seed: int
) -> Path:
    """transformers' own random init of the shape's config.json, written once with
    `save_pretrained` (atomically: a killed writer leaves no half checkpoint)."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = checkpoint_path(shape, checkpoint_dir, "transformers")
    if (path / "config.json").exists():
        return path
    config_json = shape_config_json(shape)
    if not transformers_has(config_json["model_type"]):
        raise BenchmarkInputError(
            f"transformers {transformers.__version__} has no causal LM for model_type "
            f"{config_json['model_type']!r} (shape {shape!r})"
        )
    config = CONFIG_MAPPING[config_json["model_type"]].from_dict(config_json)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    print(f"writing transformers' random {shape} ({params:,} params) to {path}", flush=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def ensure_shape_checkpoint(shape: str, args) -> Path:
    """The shape's checkpoint of --writer, written if missing (an unknown shape or writer fails
    by name)."""
    shape_config_json(shape)
    checkpoint_path(shape, args.checkpoint_dir, args.writer)
    if args.writer == "rlt":  # the directory and writer offline_throughput.py's runs use
        return ensure_checkpoint(shape, args.checkpoint_dir, args.device)
    return ensure_transformers_checkpoint(
        shape, args.checkpoint_dir, device=args.device, dtype=args.dtype, seed=args.seed
    )


def load_model(model_dir: Path, *, device: str, dtype: str):
    """transformers' causal LM of `model_dir`, eval mode, sdpa attention. Raises
    BenchmarkInputError when transformers has no model for the checkpoint's model_type."""
    import torch
    import transformers

    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if not transformers_has(model_type):
        raise BenchmarkInputError(
            f"transformers {transformers.__version__} has no causal LM for model_type "
            f"{model_type!r} ({model_dir})"
        )
    # loaded on the CPU, then moved: a device_map needs accelerate, which the CPU venv lacks
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.to(device).eval()


class _FirstLogitsClock:
    """A logits processor that marks when generate's first forward (the prefill) has produced
    logits and counts its calls (one per new token); it leaves the scores as they are."""

    def __init__(self, synchronize) -> None:
        self._synchronize = synchronize
        self.first_s: float | None = None
        self.calls = 0

    def __call__(self, input_ids, scores):
        if self.first_s is None:
            self._synchronize()
            self.first_s = time.perf_counter()
        self.calls += 1
        return scores


def generate_exactly(model, prompts, output_len: int, *, prefix_lm: bool, clock=None):
    """Greedy `generate` of exactly `output_len` new tokens (no eos); prefix_lm: token_type_ids
    of ones over the prompt. Raises RuntimeError if another number came out."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )
    extra = {"token_type_ids": torch.ones_like(prompts)} if prefix_lm else {}
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        generation_config=config,
        logits_processor=LogitsProcessorList([clock] if clock is not None else []),
        **extra,
    )
    produced = out.shape[1] - prompts.shape[1]
    if produced != output_len:
        raise RuntimeError(f"generate produced {produced} new tokens, expected {output_len}")
    return out


def time_generate(
    model, prompts, output_len: int, *, prefix_lm: bool, warmup_tokens: int = WARMUP_TOKENS
) -> GenerateTiming:
    """One warm-up generate, then one timed (see the module docstring for the marks)."""
    if output_len < 2:
        raise BenchmarkInputError("output_len must be at least 2 (token 0 is the prefill's)")

    def synchronize() -> None:
        sync(prompts.device.type)

    generate_exactly(model, prompts, min(warmup_tokens, output_len), prefix_lm=prefix_lm)
    clock = _FirstLogitsClock(synchronize)
    synchronize()
    start_s = time.perf_counter()
    generate_exactly(model, prompts, output_len, prefix_lm=prefix_lm, clock=clock)
    synchronize()
    end_s = time.perf_counter()
    if clock.calls != output_len or clock.first_s is None:
        raise RuntimeError(f"the logits clock ran {clock.calls} times, expected {output_len}")
    batch = prompts.shape[0]
    decode_s = end_s - clock.first_s
    return GenerateTiming(
        batch_size=batch,
        prompt_len=prompts.shape[1],
        output_len=output_len,
        prefill_s=round(clock.first_s - start_s, 4),
        decode_s=round(decode_s, 4),
        total_s=round(end_s - start_s, 4),
        decode_output_tokens_per_s=round(batch * (output_len - 1) / decode_s, 2),
        output_tokens_per_s=round(batch * output_len / (end_s - start_s), 2),
        prefix_lm=prefix_lm,
    )


def uses_prefix_lm(model) -> bool:
    """HRM-Text's prefix-LM prompts (config.prefix_lm); False for models without the key."""
    return bool(getattr(model.config, "prefix_lm", False))


def measure(model_dir: Path, batch_sizes: list[int], args) -> dict:
    """Load the model once and time each batch size; returns the JSON payload's body."""
    import torch
    import transformers

    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device).index or 0)
    load_start = time.perf_counter()
    model = load_model(model_dir, device=args.device, dtype=args.dtype)
    load_s = round(time.perf_counter() - load_start, 1)
    vocab = model.config.vocab_size
    prefix_lm = uses_prefix_lm(model)
    results, errors = [], []
    for batch in batch_sizes:
        prompts = random_prompts(args.seed, batch, args.prompt_len, vocab)
        prompts = torch.tensor(prompts, device=args.device)
        try:
            timing = time_generate(model, prompts, args.output_len, prefix_lm=prefix_lm)
        except torch.OutOfMemoryError as exc:
            errors.append({"batch_size": batch, "error": f"OutOfMemoryError: {exc}"})
            print(f"batch {batch}: out of memory", flush=True)
            continue
        results.append(asdict(timing))
        print(
            f"transformers generate, batch {batch}: decode {timing.decode_output_tokens_per_s} "
            f"tok/s, e2e {timing.output_tokens_per_s} tok/s, prefill {timing.prefill_s} s",
            flush=True,
        )
    return {
        "model_dir": str(model_dir),
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "load_s": load_s,
        "results": results,
        "errors": errors,
    }


def build_parser():
    p = parser(__doc__, device="cpu", dtype="bfloat16", out=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a checkpoint directory transformers loads")
    source.add_argument("--shape", help="one of workload.py's shapes")
    p.add_argument("--checkpoint-dir", default=".runs/bench-checkpoints")
    p.add_argument("--writer", default="rlt", choices=WRITERS)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-checkpoint-only", action="store_true")
    p.add_argument("--json-out", type=Path, help="write the JSON record here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model_dir = Path(args.model) if args.model else ensure_shape_checkpoint(args.shape, args)
        if args.write_checkpoint_only:
            print(f"checkpoint ready: {model_dir}", flush=True)
            return 0
        body = measure(model_dir, ints(args.batch_sizes), args)
    except BenchmarkInputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    write_json(args.json_out, record("transformers_generate", args, **body))
    return 1 if body["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
