"""The benchmark's own tokenizer (`--tokenizer`, vLLM's): what `--dataset-name sharegpt`
counts prompt and reply lengths with, and what counts a streamed reply's tokens when the
server reports no `usage`.

`name` is a local directory or a Hugging Face Hub id (`org/name`), found in the Hugging Face
cache or downloaded into it (its tokenizer files only) by `rlt_models.model_source`, as the
engine commands resolve theirs (`HF_HUB_OFFLINE=1`: the cache only); either is read with
`rlt_models.load_tokenizer`. An id that cannot be resolved, or a directory that holds no
tokenizer, is one `ConfigurationError` line naming `--tokenizer`.
"""

from __future__ import annotations

from rlt_contracts import ConfigurationError


def load_bench_tokenizer(name: str):
    """A `transformers` tokenizer for `name` (see the module docstring)."""
    from rlt_models import load_tokenizer
    from rlt_models.model_source import TOKENIZER_FILE_PATTERNS, resolve_model_source

    source = resolve_model_source(name, option="tokenizer", file_patterns=TOKENIZER_FILE_PATTERNS)
    try:
        return load_tokenizer(source.local_dir)
    except (OSError, ValueError) as exc:  # no tokenizer files, unreadable ones
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(
            "tokenizer", f"cannot load a tokenizer from {name!r}: {reason}"
        ) from None


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of a reply's text, without the special tokens a prompt would get (vLLM's count
    of a streamed output that came without usage)."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)
