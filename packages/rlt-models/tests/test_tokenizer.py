"""Tokenizers written with checkpoints load offline through transformers.AutoTokenizer."""

from __future__ import annotations

import logging

from rlt_models import OuroConfig, load_tokenizer, write_random_checkpoint

CONFIG = OuroConfig(
    vocab_size=400,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    total_ut_steps=2,
    max_position_embeddings=64,
)


def test_tokenizer_round_trip_special_tokens_and_chat_template(tmp_path):
    path = write_random_checkpoint(tmp_path / "ckpt", CONFIG)
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert len(tok) <= CONFIG.vocab_size
    text = "The river had risen during the night; price: 42!"
    ids = tok(text).input_ids
    assert all(0 <= i < CONFIG.vocab_size for i in ids)
    assert tok.decode(ids) == text
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.model_max_length == 64


def test_tokenizer_training_is_deterministic(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", CONFIG, seed=1)
    b = write_random_checkpoint(tmp_path / "b", CONFIG, seed=2)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_a_text_longer_than_the_context_logs_no_indexing_warning(tmp_path, caplog):
    """rlt checks prompt lengths itself (a 400 naming the limit): transformers' "Token indices
    sequence length is longer ... indexing errors" warning is silenced."""
    tok = load_tokenizer(write_random_checkpoint(tmp_path / "ckpt", CONFIG))
    with caplog.at_level(logging.WARNING):
        ids = tok.encode("the river " * 200, add_special_tokens=False)
        other = tok.encode("it is a truth " * 200, add_special_tokens=False)
    assert len(ids) > CONFIG.max_position_embeddings < len(other)
    assert "indexing errors" not in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("transformers")]
