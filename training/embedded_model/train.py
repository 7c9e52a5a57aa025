"""Train the embedded default Ouro model (config B, 5.5 M parameters) and export it.

Stage 1 trains everything on the Ouro objective: per token, sum_t p(t|x) CE_t - beta H(p),
where CE_t is the LM head's next-token loss on loop t's normed state and p is the exit
distribution of the gate (ouro-model-spec.md 3.7). Stage 2 freezes all but the exit gate and
trains it to exit once another loop stops helping: with I_t = max(0, CE_t - CE_{t+1}) and
w_t = sigmoid(k (I_t - gamma)), the gate loss is the mean over t < T of BCE(lambda_t, 1 - w_t).
Then the model is exported in bf16 (rlt_models.save_checkpoint) with the tokenizer, loaded
back and evaluated (evaluate.py). Writes OUT/checkpoint/, OUT/metrics.json, OUT/eval.json and
OUT/eval.png: 8 files, the most a device run brings back.

Cost estimate (FLOPs ~ 6 x effective params x tokens): a loop applies the 4 shared layers
(0.853 M params each, 3.41 M), so 4 loops are 13.6 M, plus the LM head on all 4 loops (4 x
1.05 M): ~17.8 M effective, ~107 MFLOP/token, ~113 with attention at S = 256. The defaults,
4,000 x 64 x 256 = 65.5 M tokens (11.5 epochs of train.bin), are 7.4 PFLOP: 218 s at
300 k tokens/s (34 TFLOP/s, 4 % of the H200's measured 790). Stage 2 (800 steps, 13 M tokens)
runs the body forward only (~1/3 of a step), eval and export take seconds: ~5 min in all.
The time limit re-plans stage 1 from the step time measured at steps 10-30, so slower
throughput shortens stage 1 (its cosine schedule still completes) instead of overrunning.

Seeded (weights, batch sampling); GPU kernels may still differ in the last bits between runs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rlt_models import OuroModel, RandomInit, build_model, random_ouro_tensors, save_checkpoint

from evaluate import run_evaluation, summary_line
from looped_lm import config_b, load_tokens
from stages import (
    BETA,
    EXIT_GAMMA,
    EXIT_K,
    MIN_LR_FRACTION,
    WEIGHT_DECAY,
    train_stage1,
    train_stage2,
)

INIT = RandomInit(weight_std=0.02, norm_jitter=0.0, gate_std=0.01, gate_bias=-1.0)
EMBED_STD = 1.0  # unit-RMS embeddings, like the normed states that feed loops 2..T
# Weight of the norms on the sub-block outputs (input_layernorm_2, post_attention_layernorm_2):
# small, so that at init each loop barely changes the state and no loop starts ahead.
RESIDUAL_NORM_INIT = 0.1


def init_model(seed: int, device: torch.device) -> OuroModel:
    """Config B from seeded `random_ouro_tensors` (embeddings rescaled to EMBED_STD), fp32."""
    config = config_b()
    tensors = random_ouro_tensors(config, seed=seed, init=INIT)
    tensors["model.embed_tokens.weight"] *= EMBED_STD / INIT.weight_std
    for name, tensor in tensors.items():
        if name.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight")):
            tensor.fill_(RESIDUAL_NORM_INIT)
    return build_model(config, tensors, dtype=torch.float32, device=device)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        required=True,
        help="holds train.bin, val.bin and the tokenizer files",
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--steps-stage1", type=int, default=4000)
    parser.add_argument("--steps-stage2", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3, help="stage-1 peak learning rate")
    parser.add_argument("--beta", type=float, default=BETA, help="stage-1 entropy bonus")
    parser.add_argument("--gate-lr", type=float, default=1e-3, help="stage-2 peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=400.0,
        help="wall budget from start-up (after imports) to the end of the run",
    )
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--eval-max-windows", type=int, default=0, help="0: all of val.bin")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def main() -> None:
    start = time.monotonic()
    args = parse_args()
    end_time = start + args.time_limit_s
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tokens = load_tokens(args.data_dir / "train.bin", device)
    model = init_model(args.seed, device)
    config = model.config
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__} on {name}; {config.num_parameters():,} parameters; "
        f"{tokens.numel():,} train tokens; batch {args.batch_size} x {args.seq_len}",
        flush=True,
    )
    setup_s = time.monotonic() - start
    stage1 = train_stage1(model, tokens, args, end_time)
    stage2 = train_stage2(model, tokens, args, end_time)
    export_start = time.monotonic()
    checkpoint = save_checkpoint(
        model, args.out_dir / "checkpoint", dtype="bfloat16", tokenizer_dir=args.data_dir
    )
    weights_bytes = (checkpoint / "model.safetensors").stat().st_size
    export_s = time.monotonic() - export_start
    eval_start = time.monotonic()
    evaluation = run_evaluation(
        checkpoint,
        args.data_dir,
        args.out_dir,
        device=device,
        seq_len=args.seq_len,
        batch_size=args.eval_batch_size,
        max_windows=args.eval_max_windows,
        seed=args.seed,
        curves=stage1.curves + stage2.curves,
    )
    eval_s = time.monotonic() - eval_start
    metrics = {
        "model_config": config.to_dict(),
        "parameters": config.num_parameters(),
        "weights_bytes_bf16": weights_bytes,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "recipe": {
            "exit_k": EXIT_K,
            "exit_gamma": EXIT_GAMMA,
            "init": asdict(INIT),
            "embed_std": EMBED_STD,
            "weight_decay": WEIGHT_DECAY,
            "min_lr_fraction": MIN_LR_FRACTION,
            "autocast": device.type == "cuda",
        },
        "torch": torch.__version__,
        "device": name,
        "stage1": asdict(stage1),
        "stage2": asdict(stage2),
        "tokens_seen": stage1.tokens + stage2.tokens,
        "wall_s": {
            "setup": setup_s,
            "stage1": stage1.wall_s,
            "stage2": stage2.wall_s,
            "export": export_s,
            "eval": eval_s,
            "total": time.monotonic() - start,
        },
        "eval": {k: evaluation[k] for k in ("val_loss_per_loop", "exit")},
    }
    (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print("\n".join(evaluation["samples"]), flush=True)
    early = "".join(
        f" (stage {i} stopped early)"
        for i, stage in ((1, stage1), (2, stage2))
        if stage.stopped_early
    )
    print(
        f"SUMMARY{early}: {stage1.steps_done}+{stage2.steps_done} steps, "
        f"{metrics['tokens_seen'] / 1e6:.1f} M tokens, {metrics['wall_s']['total']:.0f} s, "
        f"{weights_bytes / 1e6:.1f} MB | {summary_line(evaluation)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
