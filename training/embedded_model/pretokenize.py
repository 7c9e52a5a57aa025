"""Encode train.txt and val.txt into flat token files for training.

Each output (``train.bin``, ``val.bin``) is a raw array of little-endian uint16 token ids:
every document's ids followed by the eos id 0 (``<|endoftext|>``), documents in file order.
Load it with ``numpy.fromfile(path, dtype="<u2")`` or ``numpy.memmap``. A ``tokens.json``
next to them records the dtype, eos id, token counts and the tokenizer's SHA-256.

Documents are encoded in batches with ``Tokenizer.encode_batch_fast`` (parallel, no offsets).

Usage (from the repo root):
    uv run python training/embedded_model/pretokenize.py [--tokenizer DIR] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from corpus_io import CORPUS_DIR, EOS_TOKEN, read_documents, sha256_file, tokenizer_dir

TOKEN_DTYPE = np.dtype("<u2")


def encode_documents(tokenizer: Tokenizer, docs: list[str], eos_id: int, batch: int) -> np.ndarray:
    """Return the ids of ``docs`` as one uint16 array, each document followed by ``eos_id``."""
    parts: list[np.ndarray] = []
    for lo in range(0, len(docs), batch):
        encodings = tokenizer.encode_batch_fast(docs[lo : lo + batch], add_special_tokens=False)
        for encoding in encodings:
            parts.append(np.asarray(encoding.ids, dtype=TOKEN_DTYPE))
            parts.append(np.array([eos_id], dtype=TOKEN_DTYPE))
    return np.concatenate(parts) if parts else np.empty(0, dtype=TOKEN_DTYPE)


def main() -> None:
    """Encode both splits, write the .bin files and tokens.json, print counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=tokenizer_dir(4096),
        help="train_tokenizer.py output (default: the 4096-vocab tokenizer)",
    )
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="build_corpus.py output")
    parser.add_argument("--out", type=Path, help="default: the tokenizer directory")
    parser.add_argument("--batch-size", type=int, default=64, help="documents per encode batch")
    args = parser.parse_args()
    out_dir: Path = args.out or args.tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer_json = args.tokenizer / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    if tokenizer.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max + 1:
        raise SystemExit(f"vocab {tokenizer.get_vocab_size()} does not fit in uint16")
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id != 0:
        raise SystemExit(f"{EOS_TOKEN} has id {eos_id}, expected 0")

    meta: dict[str, object] = {
        "dtype": "uint16-le",
        "eos_id": eos_id,
        "vocab_size": tokenizer.get_vocab_size(),
        "tokenizer_sha256": sha256_file(tokenizer_json),
    }
    for split in ("train", "val"):
        start = time.perf_counter()
        docs = read_documents(args.corpus / f"{split}.txt")
        ids = encode_documents(tokenizer, docs, eos_id, args.batch_size)
        bin_path = out_dir / f"{split}.bin"
        ids.tofile(bin_path)
        text_bytes = sum(len(doc.encode()) for doc in docs)
        meta[f"{split}_tokens"] = int(ids.size)
        meta[f"{split}_documents"] = len(docs)
        print(
            f"{split:5s} {len(docs):5d} docs  {ids.size:>10,d} tokens  "
            f"{text_bytes / ids.size:.2f} bytes/token  {bin_path.stat().st_size:>11,d} B  "
            f"{sha256_file(bin_path)[:16]}  {time.perf_counter() - start:.1f} s"
        )
    (out_dir / "tokens.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
