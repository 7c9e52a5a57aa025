"""A checkpoint directory checked before anything loads: every missing piece named at once
(config.json, the weights, the tokenizer), each tokenizer layout transformers loads accepted."""

from __future__ import annotations

import pytest
from rlt_contracts import ConfigurationError
from rlt_models.model_dir import check_model_dir, missing_model_files


def test_an_empty_directory_lacks_config_weights_and_tokenizer(tmp_path):
    with pytest.raises(ConfigurationError) as error:
        check_model_dir(tmp_path)
    assert error.value.options == ("model",)
    message = str(error.value)
    assert f"{tmp_path} is not a complete checkpoint directory" in message
    assert "it lacks config.json; the weights (model.safetensors" in message
    assert "; the tokenizer (tokenizer.json" in message
    assert "sentencepiece" not in message


@pytest.mark.parametrize(
    "files",
    [
        ("tokenizer.json",),
        ("tokenizer.model",),
        ("vocab.json", "merges.txt"),
    ],
)
def test_each_tokenizer_layout_and_each_weights_layout_is_complete(tmp_path, files):
    for name in ("config.json", "model.safetensors.index.json", *files):
        (tmp_path / name).write_text("{}")
    assert missing_model_files(tmp_path) == []
    check_model_dir(tmp_path)


def test_only_the_missing_pieces_are_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "vocab.json").write_text("{}")  # without merges.txt: no tokenizer
    assert missing_model_files(tmp_path) == [
        "config.json",
        "the tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt)",
    ]
    assert missing_model_files(tmp_path, tokenizer=False) == ["config.json"]


def test_a_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(ConfigurationError, match="is not a directory"):
        check_model_dir(tmp_path / "missing")
