"""Service-level pieces: configuration, detokenization, prompt handling and the CLI."""

from __future__ import annotations

import json

import pytest
from rlt import SamplingParams
from rlt.cli import main
from rlt.engine import EngineConfig
from rlt.engine.detokenizer import IncrementalDetokenizer
from rlt.llm import _as_params_list, _as_prompt_list
from rlt_contracts import ConfigurationError, InvalidRequestError
from rlt_models import load_tokenizer


def test_engine_config_rejects_unknown_and_inconsistent_options():
    with pytest.raises(ConfigurationError) as info:
        EngineConfig.from_options(max_num_seq=4)
    assert info.value.options == ("max_num_seq",)
    with pytest.raises(ConfigurationError, match="dtype"):
        EngineConfig.from_options(dtype="int4")
    with pytest.raises(ConfigurationError, match="device"):
        EngineConfig.from_options(device="tpu")
    with pytest.raises(ConfigurationError, match="gpu_memory_utilization"):
        EngineConfig.from_options(gpu_memory_utilization=1.5)
    assert EngineConfig.from_options(kv_layout="shared").runner.layout.value == "shared"


def test_prompt_and_params_normalisation():
    assert _as_prompt_list("hi") == ["hi"]
    assert _as_prompt_list([[1, 2], (3,)]) == [[1, 2], [3]]
    with pytest.raises(InvalidRequestError, match="wrapped in a list"):
        _as_prompt_list([1, 2, 3])
    with pytest.raises(InvalidRequestError):
        _as_prompt_list([])
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        _as_params_list([SamplingParams()] * 2, 3)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3))


def test_incremental_text_equals_full_decode_and_holds_back_partial_characters(tokenizer):
    text = "Café au lait — naïve façade, 42 €!"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer)
    texts = []
    for token in ids:
        detok.add_tokens([token])
        texts.append(detok.text)
    detok.flush()
    assert detok.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in t for t in texts)  # incomplete characters are held back
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # text only grows


def test_stop_string_truncates_and_stops(tokenizer):
    ids = tokenizer("The river had risen during the night", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, stop=("had",))
    for token in ids:
        detok.add_tokens([token])
    assert detok.stopped and detok.text == "The river "
    detok.add_tokens(ids)
    assert detok.text == "The river "


def test_cli_generate_prints_text_and_exit_depths(tiny_checkpoint, capsys):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    code = main(
        [
            "generate",
            "The river",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ]
    )
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    assert (
        len(record["token_ids"]) == len(record["exit_depths"]) == 6
        and record["exit_depths"][0] == 4
    )
    code = main(
        ["generate", "The river", "--model", str(path), "--device", "cpu", "--max-tokens", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("The river") and "exit depths: 4" in out


def test_cli_reports_bad_options_without_a_traceback(tiny_checkpoint, capsys):
    path = tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)
    assert main(["generate", "x", "--model", str(path), "--device", "cpu", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(path / "nope")]) == 2
