"""The kernel-choice cache: what a start measured comes back, exactly, in a later process; a
damaged file is ignored; choices measured in this process win over the file's."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from rlt_models import fp8_linear as f8
from rlt_models import kernel_choice_cache as cache
from rlt_models import small_batch_linear as sbl

DEVICE = torch.device("cpu")  # the selectors key by device; the file format does not care


@pytest.fixture
def selectors(monkeypatch):
    monkeypatch.setattr(sbl.small_batch_linear, "choices", {})
    monkeypatch.setattr(f8.fp8_linear, "choices", {})
    monkeypatch.setattr(cache, "fingerprint", lambda device: "test")
    monkeypatch.setattr(cache, "_indexed", lambda device: device)
    return sbl.small_batch_linear.choices, f8.fp8_linear.choices


def fill(bf16: dict, fp8: dict) -> None:
    bf16[(1, 2048, 2048, torch.bfloat16, DEVICE)] = sbl.CONFIGS[9]
    bf16[(4, 6144, 2048, torch.bfloat16, DEVICE)] = None  # cuBLAS won
    bf16[(1, 99, 7, torch.float16, torch.device("meta"))] = sbl.CONFIGS[0]  # another device
    fp8[(1, 2048, 5632, torch.bfloat16, DEVICE)] = f8.Fp8Choice(f8.WEIGHT_ONLY, f8.FP8_TILES[0])
    fp8[(16, 2048, 5632, torch.bfloat16, DEVICE)] = f8.W8A8_CHOICE


def test_saved_choices_come_back_exactly(selectors, tmp_path):
    bf16, fp8 = selectors
    fill(bf16, fp8)
    path = cache.save(tmp_path / "new", DEVICE)
    assert path == tmp_path / "new" / "kernel-choices-test.json"
    assert cache.count(DEVICE) == 4
    before = {k: v for k, v in bf16.items() if k[4] == DEVICE}, dict(fp8)
    bf16.clear()
    fp8.clear()
    assert cache.load(tmp_path / "new", DEVICE) == 4
    assert (bf16, fp8) == before


def test_choices_of_this_process_win_and_nothing_is_written_without_choices(selectors, tmp_path):
    bf16, fp8 = selectors
    assert cache.save(tmp_path, DEVICE) is None and not list(tmp_path.iterdir())
    fill(bf16, fp8)
    cache.save(tmp_path, DEVICE)
    key = (1, 2048, 2048, torch.bfloat16, DEVICE)
    bf16.clear()
    bf16[key] = sbl.CONFIGS[1]  # measured here, after the file was written
    cache.load(tmp_path, DEVICE)
    assert bf16[key] == sbl.CONFIGS[1]


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"choices": [{"selector": "bf16"}]}), "[]"]
)
def test_a_damaged_file_is_ignored_with_a_warning(selectors, tmp_path, caplog, content):
    bf16, _ = selectors
    (tmp_path / "kernel-choices-test.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="rlt_models.kernel_choice_cache"):
        assert cache.load(tmp_path, DEVICE) == 0
    assert "ignoring" in caplog.text and not bf16


def test_a_missing_file_loads_nothing(selectors, tmp_path):
    assert cache.load(tmp_path / "absent", DEVICE) == 0
