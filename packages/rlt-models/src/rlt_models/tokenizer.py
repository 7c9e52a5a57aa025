"""Byte-level BPE tokenizers in the Hugging Face layout, trained and loaded fully offline.

Special tokens mirror Ouro: `<|endoftext|>` = 0 (eos, bos and pad), `<|im_start|>` = 1,
`<|im_end|>` = 2. The chat template is ChatML, as in the Ouro release.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (NFC, no prefix space) whose first ids are `SPECIAL_TOKENS`."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} for byte-level BPE, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, *, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {**special, "additional_special_tokens": list(SPECIAL_TOKENS[1:])}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


class _NoContextLengthWarning(logging.Filter):
    """transformers warns once per tokenizer when a text encodes to more tokens than
    `model_max_length` ("... will result in indexing errors"). rlt never runs such a sequence
    unchecked: the engine and the servers compare every prompt with the context length and
    refuse it with an error naming the limit, so the warning only misleads (a 400 that also
    logs a warning looks like a server fault)."""

    PREFIX = "Token indices sequence length is longer than the specified maximum"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.PREFIX)


_CONTEXT_LENGTH_WARNING = _NoContextLengthWarning()


def load_tokenizer(model_dir: str | Path):
    """`transformers.AutoTokenizer` for a local model directory, never touching the network."""
    # where transformers logs it (addFilter keeps one instance once)
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_CONTEXT_LENGTH_WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import warnings

    import transformers  # heavy import, only when a tokenizer is needed

    # AutoTokenizer peeks at config.json, whose model_type ("ouro") and rope fields transformers
    # does not know; the tokenizer class comes from tokenizer_config.json, so those warnings
    # are noise.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
