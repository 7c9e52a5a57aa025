"""The benchmark's own tokenizer (`--tokenizer`, vLLM's): what `--dataset-name sharegpt`
counts prompt and reply lengths with, and what counts a streamed reply's tokens when the
server reports no `usage`.

`name` is a local directory (read with `rlt_models.load_tokenizer`, never the network) or a
Hugging Face Hub id (`org/name`), which `transformers` resolves through the Hugging Face cache
as vLLM's benchmark does (`HF_HUB_OFFLINE=1`: the cache only). A name that does not load is a
`ConfigurationError` naming `--tokenizer`.
"""

from __future__ import annotations

from pathlib import Path

from rlt_contracts import ConfigurationError


def load_bench_tokenizer(name: str):
    """A `transformers` tokenizer for `name` (see the module docstring)."""
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            from rlt_models import load_tokenizer

            return load_tokenizer(path)
        import transformers

        return transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:  # no tokenizer files, an unknown id, offline miss
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(
            "tokenizer", f"cannot load a tokenizer from {name!r}: {reason}"
        ) from None


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of a reply's text, without the special tokens a prompt would get (vLLM's count
    of a streamed output that came without usage)."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)
