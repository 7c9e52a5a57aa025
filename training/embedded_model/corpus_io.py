"""Shared on-disk format and default paths of the embedded-model corpus files.

A corpus file is UTF-8 text holding a sequence of documents. Documents are separated by a
line that contains only ``<|endoftext|>``, the literal spelling of the tokenizer's eos token.
The separator never occurs inside a document (``write_documents`` checks), so the split is
unambiguous and readers recover exactly the documents that were written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data" / "embedded_model"
SOURCES_DIR = DATA_DIR / "sources"
CORPUS_DIR = DATA_DIR / "corpus"

EOS_TOKEN = "<|endoftext|>"
_SEPARATOR = f"\n{EOS_TOKEN}\n"


def tokenizer_dir(vocab_size: int) -> Path:
    """Default directory of the tokenizer (and the token files made with it) for a vocab size."""
    return DATA_DIR / f"tokenizer-{vocab_size}"


def write_documents(path: Path, documents: list[str]) -> None:
    """Write ``documents`` (non-empty, stripped strings) to ``path`` in corpus format."""
    for doc in documents:
        if not doc or doc != doc.strip() or EOS_TOKEN in doc:
            raise ValueError(f"document is empty, unstripped or contains {EOS_TOKEN}: {doc[:80]!r}")
    path.write_text(_SEPARATOR.join(documents) + "\n", encoding="utf-8", newline="\n")


def read_documents(path: Path) -> list[str]:
    """Return the documents stored in the corpus file ``path``."""
    text = path.read_text(encoding="utf-8")
    return text.removesuffix("\n").split(_SEPARATOR) if text else []


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 digest of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
