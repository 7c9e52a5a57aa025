"""Train the embedded model's byte-level BPE tokenizer on train.txt and verify it offline.

Training and the Hugging Face layout come from ``rlt_models.tokenizer``, so the result matches
what the engine expects: NFC normalizer, ByteLevel pre-tokenizer (no prefix space) and
decoder, special tokens ``<|endoftext|>`` = 0 (bos/eos/pad), ``<|im_start|>`` = 1,
``<|im_end|>`` = 2 as in Ouro, and a ChatML chat template. The output directory gets
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

After saving, the directory is reloaded with ``transformers.AutoTokenizer`` (HF_HUB_OFFLINE=1)
and checked: special ids, ``apply_chat_template`` output, and an exact encode/decode round
trip of every validation document and of a few hand-written samples.

Usage (from the repo root):
    uv run python training/embedded_model/train_tokenizer.py [--vocab-size 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
import unicodedata
from pathlib import Path

from rlt_models.tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    save_hf_tokenizer,
    train_byte_level_bpe,
)

from corpus_io import CORPUS_DIR, read_documents, sha256_file, tokenizer_dir

SAMPLES = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    "Fellow-Citizens of the Senate and House of Representatives:\n\nThe sum of £1,811.50 — "
    "“quoted”, café, naïve, 日本語, emoji 🙂, tabs\tand  double  spaces.",
    "<|im_start|>user\nTo be, or not to be?<|im_end|>\n<|endoftext|>",
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Who wrote Emma?"},
]
EXPECTED_CHAT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWho wrote Emma?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def verify(out_dir: Path, validation_docs: list[str], vocab_size: int) -> None:
    """Reload ``out_dir`` offline with AutoTokenizer and assert ids, template and round trips."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = load_tokenizer(out_dir)
    assert len(tok) == vocab_size, f"vocab size {len(tok)} != {vocab_size}"
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2], "special ids differ"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 0, 0)

    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == EXPECTED_CHAT, f"chat template rendered {rendered!r}"
    chat_ids = tok.encode(rendered, add_special_tokens=False)
    assert chat_ids.count(1) == 3 and chat_ids.count(2) == 2, "chat markers are not single ids"

    for text in (*SAMPLES, *validation_docs):
        ids = tok.encode(text, add_special_tokens=False, verbose=False)
        decoded = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert decoded == unicodedata.normalize("NFC", text), f"round trip failed: {text[:80]!r}"
    print(
        f"verified: AutoTokenizer offline load, ids 0/1/2, chat template, round trip of "
        f"{len(SAMPLES)} samples + {len(validation_docs)} validation documents"
    )


def main() -> None:
    """Train, save in Hugging Face layout, verify, and print size and compression."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="build_corpus.py output")
    parser.add_argument("--out", type=Path, help="default: data/embedded_model/tokenizer-<vocab>")
    parser.add_argument(
        "--model-max-length", type=int, default=1024, help="the model's context length"
    )
    args = parser.parse_args()
    out_dir: Path = args.out or tokenizer_dir(args.vocab_size)

    start = time.perf_counter()
    train_docs = read_documents(args.corpus / "train.txt")
    tokenizer = train_byte_level_bpe(train_docs, vocab_size=args.vocab_size)
    save_hf_tokenizer(tokenizer, out_dir, model_max_length=args.model_max_length)
    trained = time.perf_counter()

    validation_docs = read_documents(args.corpus / "val.txt")
    verify(out_dir, validation_docs, args.vocab_size)

    val_bytes = sum(len(d.encode()) for d in validation_docs)
    val_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(validation_docs))
    tokenizer_json = out_dir / "tokenizer.json"
    ratio = val_bytes / val_tokens
    print(f"vocab {args.vocab_size}: validation {val_tokens:,d} tokens, {ratio:.2f} bytes/token")
    print(f"{sha256_file(tokenizer_json)}  {tokenizer_json.stat().st_size:,d} B  {tokenizer_json}")
    print(f"trained in {trained - start:.1f} s, verified in {time.perf_counter() - trained:.1f} s")


if __name__ == "__main__":
    main()
