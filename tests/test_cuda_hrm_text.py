"""HRM-Text on CUDA (skipped without a GPU): its two-vector state through the decode CUDA graphs
and a prefix-LM prompt through the Triton prefill kernel's bidirectional mode.

fp32 on CUDA (TF32 off; attention by the Triton backend, decode captured as graphs) gives
transformers' own greedy tokens (tests/test_family_hrm_text.py's checkpoint, prompts and
reference: each reference step's top-2 gap exceeds 1e-4, far above fp32 rounding), with the
prompt bidirectional (prefix-LM) and causal.
"""

from __future__ import annotations

import pytest
import torch
from rlt import LLM, SamplingParams
from test_family_hrm_text import MAX_TOKENS, PROMPTS, reference, write_hf_checkpoint

pytestmark = pytest.mark.cuda

ENGINE = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefix_lm", [True, False], ids=["prefix_lm", "causal"])
def test_greedy_tokens_equal_transformers_on_cuda(tmp_path, prefix_lm):
    path = write_hf_checkpoint(tmp_path)
    expected = reference(path, prefix_lm=prefix_lm)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    overrides = None if prefix_lm else {"prefix_lm": False}
    with LLM(path, hf_overrides=overrides, **ENGINE) as llm:
        stats = llm.get_stats()
        assert stats.decode_cuda_graphs, stats.decode_eager_reason
        outputs = llm.generate(PROMPTS, params)
        assert llm.engine.core.leak_report() == []
    assert [o.token_ids for o in outputs] == expected
