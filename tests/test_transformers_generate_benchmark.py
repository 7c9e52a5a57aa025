"""benchmarks/transformers_generate.py, the transformers baseline of family_speed.py (issue 38,
item 6), on tiny checkpoints in fp32 on the CPU: it reads rlt's own HRM-Text checkpoint
directory and decodes it as rlt does (prefix-LM prompts; greedy tokens equal to rlt's), reads
rlt's Dory checkpoint or writes one of transformers' own init beside it, reports its timing
marks consistently, and family_speed's summary and table read its records.

Token equality holds where every step's top-2 logit gap exceeds MARGIN (1e-4, far above fp32
rounding of these O(1) logits; checked on an uncached forward of the generated sequence). rlt's
log-probabilities of the tokens equal transformers' prefix-LM ones within LOGPROB_TOL (1e-5;
4.8e-7 seen), while transformers' causal-prompt ones differ from those by more than 1e-4 (3e-4
seen: rlt's writer's small random weights barely depend on the mask, yet 30x the tolerance).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import family_speed  # noqa: E402
import transformers_generate as tg  # noqa: E402
from workload import random_prompts  # noqa: E402

MARGIN = 1e-4
LOGPROB_TOL = 1e-5
PROMPT_LEN, NEW_TOKENS, BATCH = 12, 5, 2


def scored(model, sequences, prompt_len: int, *, prefix_lm: bool):
    """(log-probabilities of the new tokens, top-2 logit gaps where each was chosen), from one
    uncached forward of the whole sequences."""
    extra = {}
    if prefix_lm:
        kinds = torch.zeros_like(sequences)
        kinds[:, :prompt_len] = 1  # the prompt one bidirectional block, the rest causal
        extra["token_type_ids"] = kinds
    with torch.no_grad():
        logits = model(sequences, **extra).logits[:, prompt_len - 1 : -1]
    top = logits.topk(2, dim=-1).values
    chosen = logits.log_softmax(-1).gather(-1, sequences[:, prompt_len:, None])[..., 0]
    return chosen, top[..., 0] - top[..., 1]


def test_hrm_text_reads_rlts_checkpoint_and_decodes_as_rlt_does(tmp_path):
    from rlt import LLM, SamplingParams

    args = SimpleNamespace(
        writer="rlt", checkpoint_dir=str(tmp_path), device="cpu", dtype="float32", seed=0
    )
    path = tg.ensure_shape_checkpoint("tiny-hrm-text", args)
    assert path == tmp_path / "tiny-hrm-text"  # rlt's writer, the directory the rlt runs read
    model = tg.load_model(path, device="cpu", dtype="float32")
    assert type(model).__name__ == "HrmTextForCausalLM" and tg.uses_prefix_lm(model)
    assert model.config._attn_implementation == "sdpa"
    prompts = torch.tensor(random_prompts(0, BATCH, PROMPT_LEN, model.config.vocab_size))

    timing = tg.time_generate(model, prompts, NEW_TOKENS, prefix_lm=True, warmup_tokens=2)
    assert (timing.batch_size, timing.prompt_len, timing.output_len) == (2, 12, 5)
    assert timing.prefill_s > 0 and timing.decode_s > 0
    assert timing.prefill_s + timing.decode_s == pytest.approx(timing.total_s, abs=2e-4)
    # tokens 1.. of each row over the decode time; decode_s is reported rounded to 4 decimals
    # (a 0.5e-4 s error, relative 0.5e-4 / decode_s: several 1e-3 on a fast tiny run)
    expected = BATCH * (NEW_TOKENS - 1) / timing.decode_s
    rel = 0.6e-4 / timing.decode_s + 1e-6
    assert timing.decode_output_tokens_per_s == pytest.approx(expected, rel=rel, abs=0.01)

    sequences = tg.generate_exactly(model, prompts, NEW_TOKENS, prefix_lm=True)
    assert sequences.shape == (BATCH, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(sequences[:, :PROMPT_LEN], prompts)
    prefix_logprobs, gaps = scored(model, sequences, PROMPT_LEN, prefix_lm=True)
    causal_logprobs, _ = scored(model, sequences, PROMPT_LEN, prefix_lm=False)
    assert (gaps > MARGIN).all()
    assert (prefix_logprobs - causal_logprobs).abs().max() > 10 * LOGPROB_TOL

    engine = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(path, **engine) as llm:
        outputs = llm.generate(prompts.tolist(), params)
    assert [o.token_ids for o in outputs] == sequences[:, PROMPT_LEN:].tolist()
    rlt_logprobs = torch.tensor([o.logprobs for o in outputs])
    assert (rlt_logprobs - prefix_logprobs).abs().max() < LOGPROB_TOL


@pytest.mark.parametrize("writer", ["rlt", "transformers"])
def test_dory_of_either_writer_is_timed(tmp_path, writer):
    out = tmp_path / "dory.json"
    argv = ["--shape", "tiny-dory", "--checkpoint-dir", str(tmp_path), "--device", "cpu"]
    argv += ["--dtype", "float32", "--prompt-len", "40", "--output-len", "4"]  # past the window
    argv += ["--writer", writer, "--batch-sizes", "1,3", "--json-out", str(out)]
    assert tg.main(argv) == 0
    data = json.loads(out.read_text())
    # rlt's: the directory the rlt runs read; transformers': beside it, never in its place
    path = tmp_path / "tiny-dory" if writer == "rlt" else tmp_path / "transformers" / "tiny-dory"
    assert data["model_dir"] == str(path)
    assert (tmp_path / "tiny-dory").exists() == (writer == "rlt")
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["n_recurrent_loops"], config["sliding_window"]) == (
        "dory",
        2,
        32,
    )
    assert data["architecture"] == "DoryForCausalLM" and data["errors"] == []
    assert data["transformers"] == transformers.__version__
    assert [r["batch_size"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["prefix_lm"] is False and r["output_len"] == 4
        assert r["decode_output_tokens_per_s"] > 0 and r["output_tokens_per_s"] > 0


def test_which_shapes_and_writers(tmp_path):
    shapes = ["tiny", "tiny-nanbeige", "tiny-hrm-text", "tiny-dory"]
    assert family_speed.shapes_transformers_has(shapes) == ["tiny-hrm-text", "tiny-dory"]
    with pytest.raises(tg.BenchmarkInputError, match="unknown shape 'no-such-shape'"):
        tg.shape_model_type("no-such-shape")
    with pytest.raises(tg.BenchmarkInputError, match="writer must be one of"):
        tg.checkpoint_path("tiny-dory", tmp_path, "auto")
    with pytest.raises(tg.BenchmarkInputError, match="no causal LM for model_type 'nanbeige'"):
        tg.ensure_transformers_checkpoint(
            "tiny-nanbeige", tmp_path, device="cpu", dtype="float32", seed=0
        )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "ouro"}))
    with pytest.raises(tg.BenchmarkInputError, match="no causal LM for model_type 'ouro'"):
        tg.load_model(tmp_path, device="cpu", dtype="float32")


def test_family_speed_summary_and_table_read_the_records():
    records = [
        {"concurrency": 1, "decode_output_tokens_per_s": 10.0, "rc": 0},
        {"concurrency": 32, "rc": 1, "error": "OutOfMemoryError: ..."},  # not timed
    ]
    summary = {"shape": "hrm-text-1b", "decode_tok_s": {1: 160.5, 32: 1869.0, 128: 3000.0}}
    family_speed.add_to_summary(summary, records)
    assert summary["transformers_decode_tok_s"] == {1: 10.0}
    assert summary["rlt_over_transformers_decode"] == {1: 16.05}
    assert family_speed.table_cells(summary, [1, 32]) == ["10.0 / failed", "16.05x / n/a"]
    assert family_speed.table_cells({"shape": "tiny"}, [1, 32]) == ["n/a", "n/a"]
