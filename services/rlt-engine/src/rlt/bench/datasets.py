"""The requests of a benchmark: a seeded synthetic length distribution, or a JSONL file.

`random`: input and output lengths are drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)] (vLLM's random dataset). For
`/v1/completions` the prompt is a list of token ids drawn uniformly from [0, vocab_size), so the
input length is exact. For `/v1/chat/completions` (which takes text) it is one user message of
that many random common English words: about one token each, so the input length is
approximate; the server's `usage.prompt_tokens` is what gets reported. With `prefix_len` P
(vLLM's `--random-prefix-len`) every prompt starts with the same P random ids (words), drawn
once, before its own random part: a prompt has P + its drawn input length tokens, and a
server's prefix cache can share the first P.

`sharegpt` (vLLM's ShareGPT JSON, with a tokenizer) lives in `rlt.bench.sharegpt`.

`jsonl`: one JSON object per line, `{"prompt": "text"}` (or a list of token ids, completions
only) or `{"messages": [...]}` (chat only), optionally with `"max_tokens"` (else the default
output length). A text prompt sent to the chat endpoint becomes one user message. Lines are
used in file order, cycling when `num_prompts` exceeds them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlt_contracts import ConfigurationError

DEFAULT_VOCAB_SIZE = 256  # ids every model here has (the test checkpoints have 272+)

# Common short English words: most are a single token in BPE vocabularies.
WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a completions `prompt` (text or token ids) or chat `messages`."""

    index: int
    output_len: int  # max_tokens
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_len: int | None = None  # exact where known (token-id prompts), else None


def cycled(entries: list[BenchRequest], num_prompts: int) -> list[BenchRequest]:
    """`num_prompts` requests indexed 0.., taking `entries` in turn (from the first again)."""
    return [replace(entries[i % len(entries)], index=i) for i in range(num_prompts)]


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_requests(
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    chat: bool,
    range_ratio: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` synthetic requests; the same arguments always give the same requests."""
    if num_prompts < 1:
        raise ConfigurationError("num_prompts", f"must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ConfigurationError(
            ("random_input_len", "random_output_len"),
            f"must be >= 1, got {input_len} and {output_len}",
        )
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigurationError("random_range_ratio", f"must be in [0, 1), got {range_ratio}")
    if vocab_size < 1:
        raise ConfigurationError("random_vocab_size", f"must be >= 1, got {vocab_size}")
    if prefix_len < 0:
        raise ConfigurationError("random_prefix_len", f"must be >= 0, got {prefix_len}")
    rng = random.Random(seed)
    input_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    # drawn after the lengths (and nothing when 0): prefix_len 0 keeps every earlier workload
    if chat:
        prefix_words = [rng.choice(WORDS) for _ in range(prefix_len)]
    else:
        prefix_ids = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    requests = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens, strict=True)):
        if chat:
            text = " ".join(prefix_words + [rng.choice(WORDS) for _ in range(n_in)])
            messages = [{"role": "user", "content": text}]
            requests.append(BenchRequest(i, n_out, messages=messages))
        else:
            ids = prefix_ids + [rng.randrange(vocab_size) for _ in range(n_in)]
            requests.append(BenchRequest(i, n_out, prompt=ids, prompt_len=len(ids)))
    return requests


def _parse_line(number: int, line: str, *, chat: bool, default_output_len: int) -> BenchRequest:
    where = f"line {number}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigurationError("dataset_path", f"{where}: not JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise ConfigurationError("dataset_path", f"{where}: expected a JSON object")
    output_len = entry.get("max_tokens", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ConfigurationError("dataset_path", f"{where}: max_tokens must be an integer >= 1")
    prompt, messages = entry.get("prompt"), entry.get("messages")
    if (prompt is None) == (messages is None):
        raise ConfigurationError("dataset_path", f"{where}: give exactly one of prompt, messages")
    if messages is not None:
        if not chat:
            raise ConfigurationError(
                "dataset_path", f"{where}: messages need the chat endpoint (/v1/chat/completions)"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ConfigurationError("dataset_path", f"{where}: messages must be a list of objects")
        return BenchRequest(0, output_len, messages=messages)
    if isinstance(prompt, str):
        if chat:
            return BenchRequest(0, output_len, messages=[{"role": "user", "content": prompt}])
        return BenchRequest(0, output_len, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if chat:
            raise ConfigurationError(
                "dataset_path", f"{where}: token-id prompts need /v1/completions"
            )
        return BenchRequest(0, output_len, prompt=prompt, prompt_len=len(prompt))
    raise ConfigurationError(
        "dataset_path", f"{where}: prompt must be a string or a non-empty list of token ids"
    )


def jsonl_requests(
    path: str | Path, num_prompts: int, *, chat: bool, default_output_len: int
) -> list[BenchRequest]:
    """`num_prompts` requests from a JSONL file (in file order, cycling if it is shorter)."""
    if num_prompts < 1:
        raise ConfigurationError("num_prompts", f"must be >= 1, got {num_prompts}")
    if default_output_len < 1:
        raise ConfigurationError("jsonl_output_len", f"must be >= 1, got {default_output_len}")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigurationError("dataset_path", f"cannot read {path}: {exc}") from None
    entries = [
        _parse_line(number, line, chat=chat, default_output_len=default_output_len)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not entries:
        raise ConfigurationError("dataset_path", f"{path} has no prompts")
    return cycled(entries, num_prompts)
