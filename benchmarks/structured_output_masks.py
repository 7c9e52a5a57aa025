"""Grammar engines for structured output, measured: llguidance vs xgrammar.

For an Ouro-sized vocabulary (151,936 tokens) this measures, per engine, what the host pays to
constrain one request: compiling a JSON schema and a regex (cold, no cache), creating a
matcher, and then for every token of a few hundred tokens of generation the time to compute the
next-token bitmask (int32 words [ceil(V/32)]; median and p99) and to advance the matcher with
the sampled token. The "generation" is the tokenization of a valid instance (one JSON document
of the schema, one string matching the regex), fed token by token as a sampler would.

Real Ouro uses the Qwen2 tokenizer (151,643 BPE tokens + specials, padded to 151,936). Without
one on disk (`--tokenizer`), a byte-level BPE of exactly 151,936 tokens is trained with
`tokenizers` on local text (Python sources of the standard library and the workspace's
environment), which has the same structure (byte-level BPE, GPT-2 pre-tokenization, ~151k
merges) but not Qwen's exact merges.

Run in an environment with both candidates (neither is a workspace dependency of this script):

    uv run --no-project --with llguidance --with xgrammar --with tokenizers \
        python benchmarks/structured_output_masks.py [--tokenizer tokenizer.json]

Prints a markdown table; docs/results.md ("Structured output: grammar engine") has the numbers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

VOCAB_SIZE = 151_936

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "category": {"enum": ["book", "garden", "kitchen", "toy"]},
                },
                "required": ["sku", "quantity", "price", "category"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "notes"],
    "additionalProperties": False,
}

REGEX = r"(\d{4}-\d{2}-\d{2} [A-Z][a-z]+ (ok|failed|retry) in \d+ ms\n){5,40}"


def json_instance() -> str:
    categories = ["book", "garden", "kitchen", "toy"]
    items = [
        {
            "sku": f"item-{i:04d}-{'abcdefgh'[i % 8]}",
            "quantity": 1 + i % 5,
            "price": round(3.25 * (i + 1), 2),
            "category": categories[i % 4],
        }
        for i in range(14)
    ]
    document = {
        "order_id": "ABC-123456",
        "customer": {"name": "Emma Woodhouse", "email": "emma@hartfield.example", "vip": True},
        "items": items,
        "notes": "Leave the parcel with Mr. Knightley if nobody answers the door.",
    }
    return json.dumps(document, indent=2)


def regex_instance() -> str:
    names = ["Hartfield", "Donwell", "Randalls", "Highbury", "Enscombe"]
    outcomes = ["ok", "failed", "retry"]
    return "".join(
        f"2026-11-{1 + i % 28:02d} {names[i % 5]} {outcomes[i % 3]} in {17 * i + 3} ms\n"
        for i in range(30)
    )


def train_tokenizer(path: Path) -> None:
    """A byte-level BPE of exactly VOCAB_SIZE tokens trained on local Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    roots = [os.path.dirname(os.__file__), *sys.path]
    files, total = [], 0
    for root in dict.fromkeys(r for r in roots if os.path.isdir(r)):
        for name in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            size = os.path.getsize(name)
            files.append(name)
            total += size
            if total > 120e6:
                break
        if total > 120e6:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained {tokenizer.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    tokenizer.save(str(path))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(name: str, grammar: str, compile_s: float, matcher_s: float, masks, accepts) -> dict:
    return {
        "engine": name,
        "grammar": grammar,
        "compile_ms": compile_s * 1e3,
        "matcher_ms": matcher_s * 1e3,
        "tokens": len(masks),
        "mask_mean_us": statistics.fmean(masks) * 1e6,
        "mask_median_us": statistics.median(masks) * 1e6,
        "mask_p99_us": percentile(masks, 0.99) * 1e6,
        "mask_max_us": max(masks) * 1e6,
        "accept_median_us": statistics.median(accepts) * 1e6,
    }


def bench_llguidance(tokenizer_json: str, eos: int, cases) -> list[dict]:
    import llguidance
    import llguidance.numpy as llg_numpy

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB_SIZE, eos_token=eos)
    setup_s = time.perf_counter() - start
    results = []
    for label, kind, spec, tokens in cases:
        start = time.perf_counter()
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        llguidance_mask = llg_numpy.allocate_token_bitmask(1, VOCAB_SIZE)
        llg_numpy.fill_next_token_bitmask(matcher, llguidance_mask, 0)  # first mask: lazy work
        compile_s = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar)  # warm: grammar text seen before
        matcher_s = time.perf_counter() - start
        masks, accepts = [], []
        for token in tokens:
            t0 = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(matcher, llguidance_mask, 0)
            t1 = time.perf_counter()
            allowed = (int(llguidance_mask[0, token // 32]) >> (token % 32)) & 1
            assert allowed, f"llguidance disallowed token {token}"
            assert matcher.consume_token(token), matcher.get_error()
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
        llg_numpy.fill_next_token_bitmask(matcher, llguidance_mask, 0)
        assert (int(llguidance_mask[0, eos // 32]) >> (eos % 32)) & 1, "EOS not allowed at end"
        results.append(summary("llguidance", label, compile_s, matcher_s, masks, accepts))
    for r in results:
        r["tokenizer_setup_ms"] = setup_s * 1e3
    return results


def bench_xgrammar(tokenizer_path: Path, eos: int, cases) -> list[dict]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), eos_token="<|endoftext|>")
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=[eos])
    setup_s = time.perf_counter() - start
    results = []
    for label, kind, spec, tokens in cases:
        compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        start = time.perf_counter()
        if kind == "json":
            compiled = compiler.compile_json_schema(spec)
        else:
            compiled = compiler.compile_regex(spec)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiled)
        matcher_s = time.perf_counter() - start
        bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
        masks, accepts = [], []
        for token in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
            assert allowed, f"xgrammar disallowed token {token}"
            assert matcher.accept_token(token)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
        matcher.fill_next_token_bitmask(bitmask)
        assert (int(bitmask[0, eos // 32]) >> (eos % 32)) & 1, "EOS not allowed at end"
        results.append(summary("xgrammar", label, compile_s, matcher_s, masks, accepts))
    for r in results:
        r["tokenizer_setup_ms"] = setup_s * 1e3
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json with 151,936 tokens")
    parser.add_argument(
        "--cache", type=Path, default=Path("/tmp/rlt_bpe151936.json"), help="trained BPE cache"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    path = args.tokenizer or args.cache
    if not path.exists():
        print(f"training a {VOCAB_SIZE}-token byte-level BPE into {path} ...", file=sys.stderr)
        train_tokenizer(path)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    cases = []
    for label, kind, spec, text in [
        ("json_schema", "json", json.dumps(SCHEMA), json_instance()),
        ("regex", "regex", REGEX, regex_instance()),
    ]:
        cases.append((label, kind, spec, tokenizer.encode(text).ids))
    results = bench_llguidance(path.read_text(), eos, cases) + bench_xgrammar(path, eos, cases)
    print(f"vocabulary {tokenizer.get_vocab_size()} tokens ({path}); CPU threads {os.cpu_count()}")
    header = (
        "| engine | grammar | tokens | mask mean us | mask median us | mask p99 us | mask max us | "
        "accept median us | compile ms | matcher ms | tokenizer setup ms |"
    )
    print(header)
    print("|" + " --- |" * 11)
    for r in results:
        print(
            f"| {r['engine']} | {r['grammar']} | {r['tokens']} | {r['mask_mean_us']:.0f} | "
            f"{r['mask_median_us']:.0f} | "
            f"{r['mask_p99_us']:.0f} | {r['mask_max_us']:.0f} | {r['accept_median_us']:.0f} | "
            f"{r['compile_ms']:.1f} | {r['matcher_ms']:.2f} | {r['tokenizer_setup_ms']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
