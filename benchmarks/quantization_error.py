"""Per-loop error of bf16, fp8 weights and an fp8 KV cache on the random Ouro-1.4B shape (issue 22).

One random Ouro-1.4B-shaped model (the benchmarks' init: weights std 0.02, gate std 0.05, seed
0), built in memory in fp32, runs `--tokens` random token ids at full depth (the Hugging Face
forward: every position through all T loops, one dense cache per loop). Each arm runs the same
tokens; per loop t it records the end-of-loop hidden state h_t, the logits coda(h_t) and the
gate's exit probability p_t, and compares them with the fp32 reference:

  hidden_rel_error      ||h_t - h_t_ref|| / ||h_t_ref|| over all positions
  logit_max_abs_error   max |logits_t - logits_t_ref|; logit_rel_error as for the hidden state
  top1_agreement        share of positions whose argmax over logits_t equals the reference's
  exit_cdf_max_error    max over positions of |CDF_t - CDF_t_ref|, CDF_t = the probability of
                        having exited by loop t (1 - prod_{s<=t} (1 - p_s)), the gate's
                        cumulative exit probability; exit_cdf_mean_error its mean

Arms: `bf16` (the model in bf16), `fp8` (fp8 projections, fp32 activations: the CPU reference
path, exactly the dequantized weights), `fp8-bf16` (fp8 projections, bf16 activations),
`fp8kv` (fp32, keys and values rounded through an e4m3 cache with calibrated per-layer scales,
`rlt_models.kv_scales`). Runs on the CPU (about 6 GB of fp32 weights per model):

    uv run python benchmarks/quantization_error.py --tokens 128 --out quantization_error_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def run_loops(model, ids: torch.Tensor, rounding=None) -> list[dict[str, torch.Tensor]]:
    """Per loop: hidden, logits (fp32) and exit probability of every position."""
    from rlt_models import DenseCausalAttention, DenseKVCache

    class RoundedKV(DenseCausalAttention):
        def __call__(self, layer, query, key, value):
            return super().__call__(layer, query, *rounding(layer, key, value))

    attention_type = DenseCausalAttention if rounding is None else RoundedKV
    positions = torch.arange(len(ids))
    loops = []
    with torch.no_grad():
        hidden = model.embed(ids)
        for _ in range(model.shape.num_loops):
            attention = attention_type(DenseKVCache(model.shape.num_layers))
            hidden, exit_probability = model.recurrent_step(hidden, positions, attention)
            loops.append(
                dict(
                    hidden=hidden.float(),
                    logits=model.coda(hidden).float(),
                    exit=exit_probability.float(),
                )
            )
    return loops


def cumulative_exit(loops) -> list[torch.Tensor]:
    survive, cdf = torch.ones_like(loops[0]["exit"]), []
    for loop in loops:
        survive = survive * (1 - loop["exit"])
        cdf.append(1 - survive)
    return cdf


def compare(loops, reference) -> list[dict]:
    rows = []
    cdf, cdf_ref = cumulative_exit(loops), cumulative_exit(reference)
    for t, (got, ref) in enumerate(zip(loops, reference, strict=True)):
        logit_error = got["logits"] - ref["logits"]
        rows.append(
            dict(
                loop=t + 1,
                hidden_rel_error=float(
                    (got["hidden"] - ref["hidden"]).norm() / ref["hidden"].norm()
                ),
                logit_rel_error=float(logit_error.norm() / ref["logits"].norm()),
                logit_max_abs_error=float(logit_error.abs().max()),
                top1_agreement=float(
                    (got["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean()
                ),
                exit_cdf_max_error=float((cdf[t] - cdf_ref[t]).abs().max()),
                exit_cdf_mean_error=float((cdf[t] - cdf_ref[t]).abs().mean()),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--arms", default="bf16,fp8,fp8-bf16,fp8kv")
    parser.add_argument("--out")
    args = parser.parse_args()
    from rlt_attention.kv_store import quantize
    from rlt_models import OuroConfig, RandomInit, build_model, random_ouro_tensors
    from rlt_models.kv_scales import calibrate_kv_scales

    torch.manual_seed(0)
    config = OuroConfig.ouro_1_4b()
    tensors = random_ouro_tensors(config, seed=0, init=RandomInit(gate_std=0.05))
    ids = torch.randint(3, config.vocab_size, (args.tokens,))

    def build(dtype, quantization=None):
        return build_model(config, tensors, dtype=dtype, quantization=quantization)

    started = time.perf_counter()
    reference_model = build(torch.float32)
    reference = run_loops(reference_model, ids)
    results = dict(args=vars(args), shape="ouro-1.4b", arms=[])
    arms = args.arms.split(",")
    # the fp8 KV arm reuses the fp32 model, which is then freed (about 6 GB per fp32 model)
    arms.sort(key=lambda arm: arm != "fp8kv")
    for arm in arms:
        rounding = None
        if arm == "fp8kv":
            model = reference_model
            keys, values = calibrate_kv_scales(model, ids.tolist())

            def rounding(layer, key, value, keys=keys, values=values):
                k, v = torch.tensor(keys[layer]), torch.tensor(values[layer])
                return quantize(key, k).float() * k, quantize(value, v).float() * v

        else:
            reference_model = None
            dtype = torch.bfloat16 if arm.endswith("bf16") else torch.float32
            model = build(dtype, "fp8" if arm.startswith("fp8") else None)
        rows = compare(run_loops(model, ids, rounding), reference)
        results["arms"].append(dict(arm=arm, loops=rows))
        print(json.dumps(dict(arm=arm, loops=rows)), flush=True)
        del model
    results["wall_s"] = round(time.perf_counter() - started, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
