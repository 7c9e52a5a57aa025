"""vLLM's ShareGPT workload: `rlt bench serve --dataset-name sharegpt --dataset-path FILE`.

FILE is a JSON list of conversations in ShareGPT's layout (e.g. the
`ShareGPT_V3_unfiltered_cleaned_split.json` that vLLM's docs download):

    [{"id": "...", "conversations": [{"from": "human", "value": "prompt ..."},
                                      {"from": "gpt", "value": "reply ..."}, ...]}, ...]

As `vllm bench serve` samples it: entries with fewer than two turns are dropped, the rest
shuffled with `--seed` (Python's `random.shuffle` after seeding, so the order is vLLM's for the
same seed and file); each request is the first turn as its prompt (one user message for chat)
and the second turn's length in tokens as its `max_tokens`, or `--sharegpt-output-len`.
Lengths are counted with the tokenizer (`input_ids` with its special tokens, as vLLM), and a
pair is skipped when the prompt has fewer than 4 tokens, the reply fewer than 4 (only when it
sets the length), the prompt more than 1,024, or both together more than 2,048. When fewer
pairs qualify than requests are asked for, they are used again in order.

Worked example: with `--num-prompts 3` and a file of four conversations, one of them a single
turn and one whose 2-token reply fails the length check, the two that qualify give requests
0, 1 and 0 again, each with `prompt_len` the prompt's token count (what the benchmark reports
as input length when the server sends no usage).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlt_contracts import ConfigurationError

from rlt.bench.datasets import BenchRequest, cycled

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def is_valid_pair(prompt_len: int, output_len: int, *, fixed_output: bool) -> bool:
    """vLLM's length filter for a (prompt, reply) pair (`is_valid_sequence`)."""
    if prompt_len < MIN_LEN or prompt_len > MAX_PROMPT_LEN:
        return False
    if not fixed_output and output_len < MIN_LEN:
        return False
    return prompt_len + output_len <= MAX_TOTAL_LEN


def _load(path: str | Path) -> list:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError("dataset_path", f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError("dataset_path", f"{path} is not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ConfigurationError(
            "dataset_path", f"{path}: a ShareGPT file is a JSON list of conversations"
        )
    return data


def _first_pair(entry, number: int, path) -> tuple[str, str] | None:
    """(prompt, reply) of a conversation, None with fewer than two turns."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2]]
    if not all(isinstance(text, str) for text in texts):
        raise ConfigurationError(
            "dataset_path",
            f'{path}: conversation {number}: its first two turns need a string "value"',
        )
    return texts[0], texts[1]


def sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    *,
    chat: bool,
    tokenizer,
    output_len: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests sampled from a ShareGPT file (see the module docstring)."""
    if num_prompts < 1:
        raise ConfigurationError("num_prompts", f"must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ConfigurationError("sharegpt_output_len", f"must be >= 1, got {output_len}")
    pairs = [
        pair
        for number, entry in enumerate(_load(path))
        if (pair := _first_pair(entry, number, path)) is not None
    ]
    random.Random(seed).shuffle(pairs)
    chosen: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(chosen) == num_prompts:
            break
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if not is_valid_pair(prompt_len, reply_len, fixed_output=output_len is not None):
            continue
        if chat:
            messages = [{"role": "user", "content": prompt}]
            chosen.append(BenchRequest(0, reply_len, messages=messages, prompt_len=prompt_len))
        else:
            chosen.append(BenchRequest(0, reply_len, prompt=prompt, prompt_len=prompt_len))
    if not chosen:
        raise ConfigurationError(
            "dataset_path",
            f"{path}: no conversation qualifies (two turns, prompt of {MIN_LEN}..{MAX_PROMPT_LEN} "
            f"tokens, reply of at least {MIN_LEN}, at most {MAX_TOTAL_LEN} together)",
        )
    return cycled(chosen, num_prompts)
