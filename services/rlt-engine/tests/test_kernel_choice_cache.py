"""The engine's start-up cache directory (`EngineConfig.cache_dir`): where it is, how it is
turned off, and on CUDA that a second start reads the first one's kernel choices instead of
measuring them and makes the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlt.engine import EngineConfig


def test_the_cache_directory_resolves_as_documented(monkeypatch, tmp_path):
    monkeypatch.delenv("RLT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert EngineConfig.from_options().resolved_cache_dir() == tmp_path / "xdg" / "rlt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert EngineConfig.from_options().resolved_cache_dir() == Path.home() / ".cache" / "rlt"
    monkeypatch.setenv("RLT_CACHE_DIR", str(tmp_path / "env"))
    assert EngineConfig.from_options().resolved_cache_dir() == tmp_path / "env"
    assert (
        EngineConfig.from_options(cache_dir=tmp_path / "given").resolved_cache_dir()
        == tmp_path / "given"
    )
    assert EngineConfig.from_options(cache_dir="off").resolved_cache_dir() is None
    monkeypatch.setenv("RLT_CACHE_DIR", "off")
    assert EngineConfig.from_options().resolved_cache_dir() is None


@pytest.mark.cuda
def test_a_second_start_reads_the_kernel_choices_and_makes_the_same_tokens(
    llm_factory, monkeypatch, tmp_path
):
    import torch
    from rlt import SamplingParams
    from rlt_models import fp8_linear, kernel_choice_cache
    from rlt_models import small_batch_linear as sbl

    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(sbl.small_batch_linear, "choices", {})
    monkeypatch.setattr(fp8_linear.fp8_linear, "choices", {})  # bf16 here: none of these
    params = SamplingParams(max_tokens=8, exit_threshold=0.6, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 200, 3, 99], [250, 11]]
    options = dict(device="cuda", dtype="bfloat16", cache_dir=tmp_path)
    first = llm_factory(**options).generate(prompts, params)
    [written] = tmp_path.glob("kernel-choices-*.json")
    assert written == kernel_choice_cache.cache_file(tmp_path, device)
    measured = dict(sbl.small_batch_linear.choices)
    assert measured  # the warm-up measured the decode shapes

    def no_measuring(rows, weight):
        raise AssertionError("a restored shape was measured again")

    monkeypatch.setattr(sbl.small_batch_linear, "choices", {})
    monkeypatch.setattr(sbl.SmallBatchLinear, "_measure", staticmethod(no_measuring))
    second = llm_factory(**options).generate(prompts, params)
    assert sbl.small_batch_linear.choices == measured
    assert kernel_choice_cache.count(device) == len(measured)
    assert [(o.token_ids, o.exit_depths, o.logprobs) for o in second] == [
        (o.token_ids, o.exit_depths, o.logprobs) for o in first
    ]
