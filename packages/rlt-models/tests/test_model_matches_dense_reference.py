"""The runtime model's prelude -> recurrent -> coda path equals the literal dense reference.

Tolerance: the runtime computes in fp32, the reference in fp64. fp32 rounding over a few tiny
layers gives relative errors around 1e-7..1e-6, so max|a-b| / max|ref| < 1e-5 leaves a 10x
margin while still catching any wrong norm placement, RoPE phase or mask (errors of 1e-2+).
"""

from __future__ import annotations

import pytest
import torch
from oracle.dense_ouro import DenseOuro
from rlt_models import DenseCausalAttention, DenseKVCache, load_model

TOLERANCE = 1e-5


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def run_runtime(model, token_ids: list[int]):
    """Full-depth runtime pass; returns per-loop hidden, exit probabilities and logits."""
    ids = torch.tensor(token_ids)
    positions = torch.arange(len(token_ids))
    caches = [DenseKVCache(model.shape.num_layers) for _ in range(model.shape.num_loops)]
    h = model.embed(ids)
    hidden, probs = [], []
    for loop in range(model.shape.num_loops):
        h, p = model.recurrent_step(h, positions, DenseCausalAttention(caches[loop]))
        hidden.append(h)
        probs.append(p)
    hidden_t = torch.stack(hidden)
    return hidden_t, torch.stack(probs), model.coda(hidden_t)


@pytest.mark.parametrize("shape", ["l2_t4", "l3_t2", "l1_t3_mha"])
def test_runtime_path_matches_dense_reference(tiny_checkpoint, shape):
    path = tiny_checkpoint(shape, seed=3, gate_std=0.3)
    model = load_model(path, dtype="float32")
    reference = DenseOuro(path)
    token_ids = [5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 9]
    hidden, exit_probs, logits = run_runtime(model, token_ids)
    ref = reference.forward(token_ids)
    assert rel_error(hidden, ref.hidden) < TOLERANCE
    assert rel_error(logits, ref.logits) < TOLERANCE
    assert rel_error(exit_probs, torch.sigmoid(ref.gate_logits)) < TOLERANCE
    # exit CDF: 1 - prod(1 - lambda) over loops before the last; the last loop takes the rest
    survival = torch.cumprod(1 - exit_probs.double(), dim=0)
    cdf = torch.cat([1 - survival[:-1], torch.ones_like(survival[-1:])])
    assert torch.allclose(cdf, ref.exit_cdf, atol=1e-6)
    assert torch.equal(logits[-1].argmax(-1), ref.logits[-1].argmax(-1))


def test_incremental_decode_equals_full_sequence(tiny_checkpoint):
    """Feeding one position at a time through per-loop caches equals the full-sequence pass:
    positions (RoPE phases) are fixed across loops and the caches are per (loop, layer)."""
    model = load_model(tiny_checkpoint("l2_t4", seed=3), dtype="float32")
    token_ids = [5, 17, 200, 3, 99, 42, 7]
    full_hidden, _, _ = run_runtime(model, token_ids)
    caches = [DenseKVCache(model.shape.num_layers) for _ in range(model.shape.num_loops)]
    for position, token in enumerate(token_ids):
        h = model.embed(torch.tensor([token]))
        for loop in range(model.shape.num_loops):
            h, _ = model.recurrent_step(
                h, torch.tensor([position]), DenseCausalAttention(caches[loop])
            )
            assert rel_error(h, full_hidden[loop, position : position + 1]) < TOLERANCE


def test_bfloat16_model_tracks_fp32(tiny_checkpoint):
    """bf16 weights/activations stay close to fp32 (bf16 has ~3 significant digits)."""
    path = tiny_checkpoint("l2_t4", seed=3)
    token_ids = [5, 17, 200, 3, 99]
    _, _, logits32 = run_runtime(load_model(path, dtype="float32"), token_ids)
    _, _, logits16 = run_runtime(load_model(path, dtype="bfloat16"), token_ids)
    assert logits16.dtype == torch.bfloat16
    assert rel_error(logits16.float(), logits32) < 5e-2
