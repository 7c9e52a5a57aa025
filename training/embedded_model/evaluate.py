"""Evaluate an exported embedded Ouro checkpoint on val.bin, teacher-forced at full depth.

Reports the validation loss of the LM head on every loop's state, and the exit depths that
the engine's rule gives from the per-loop gates: exit after loop k once
1 - prod_{j<=k} (1 - lambda_j) >= threshold, never before min_loops, always at the last loop
(rlt_scheduler.exit_policy.OuroExitPolicy). Writes eval.json and eval.png (if matplotlib is
installed) and prints a one-line summary. Also called at the end of train.py.

Usage (from the repo root; CPU works, --max-windows makes it quick):
    uv run python training/embedded_model/evaluate.py --checkpoint OUT/checkpoint \
        --data-dir data/embedded_model/tokenizer-4096 [--device cpu] [--max-windows 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from rlt_models import DenseCausalAttention, DenseKVCache, OuroModel, load_model
from tokenizers import Tokenizer

from looped_lm import load_tokens, loop_losses, loop_states, windows

THRESHOLDS = (0.5, 0.7, 0.9)
MIN_LOOPS = (1, 2)
PROMPTS = (
    "It is a truth universally acknowledged",
    "Fellow-Citizens of the Senate and House of Representatives:",
    "KING HENRY. Once more unto the breach",
)


@torch.no_grad()
def collect(
    model: OuroModel, tokens: torch.Tensor, seq_len: int, batch_size: int, max_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and gate probability lambda of every loop, both [T, M] fp32 on the CPU,
    over the non-overlapping windows of `tokens` [n] (M = windows * seq_len targets)."""
    count = (tokens.numel() - 1) // seq_len
    if max_windows > 0:
        count = min(count, max_windows)
    starts = torch.arange(count) * seq_len
    losses, gates = [], []
    for lo in range(0, count, batch_size):
        rows = windows(tokens, starts[lo : lo + batch_size], seq_len)
        states = loop_states(model, rows[:, :-1])
        losses.append(loop_losses(model, states, rows[:, 1:]).cpu())
        gates.append(torch.stack([model.exit_probability(h) for h in states]).cpu())
    return torch.cat(losses, 1), torch.cat(gates, 1)


def exit_depths(gates: torch.Tensor, threshold: float, min_loops: int) -> torch.Tensor:
    """1-based exit loop [M] of the engine's rule from fp32 gate probabilities [T, M] (the
    survival product is taken in float64, as the scheduler's Python floats are)."""
    cdf = 1.0 - torch.cumprod(1.0 - gates.double(), dim=0)
    loops = torch.arange(1, gates.shape[0] + 1)[:, None]
    exits = (cdf >= threshold) & (loops >= min_loops)
    exits[-1] = True
    return exits.int().argmax(dim=0) + 1  # argmax returns the first maximal index


def summarize(losses: torch.Tensor, gates: torch.Tensor) -> dict[str, Any]:
    """eval.json content from per-token losses and gates [T, M]."""
    loops, count = losses.shape
    exits = []
    for min_loops in MIN_LOOPS:
        for threshold in THRESHOLDS:
            depth = exit_depths(gates, threshold, min_loops)
            histogram = torch.bincount(depth, minlength=loops + 1)[1:].double() / count
            exits.append(
                {
                    "threshold": threshold,
                    "min_loops": min_loops,
                    "depth_fraction": [round(x, 5) for x in histogram.tolist()],
                    "mean_depth": round(depth.double().mean().item(), 4),
                    "val_loss_at_exit": round(losses.gather(0, depth[None] - 1).mean().item(), 4),
                }
            )
    return {
        "tokens": count,
        "val_loss_per_loop": [round(x, 4) for x in losses.mean(1).tolist()],
        "mean_gate_per_loop": [round(x, 4) for x in gates.mean(1).tolist()],
        "exit": exits,
    }


@torch.no_grad()
def generate(
    model: OuroModel, prompt: list[int], max_new_tokens: int, temperature: float, seed: int
) -> list[int]:
    """Full-depth decoding with one dense KV cache per loop; temperature 0 is greedy.
    Returns the new token ids (stops after an eos)."""
    caches = [DenseKVCache(model.config.num_hidden_layers) for _ in range(model.shape.num_loops)]
    generator = torch.Generator(device=model.device).manual_seed(seed)
    new = torch.tensor(prompt, device=model.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        start = caches[0].length()
        positions = torch.arange(start, start + new.numel(), device=model.device)
        hidden = model.embed(new)
        for cache in caches:
            attention = DenseCausalAttention(cache)
            hidden, _ = model.recurrent_step(hidden, positions, attention, compute_gate=False)
        logits = model.coda(hidden[-1:]).float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            new = torch.multinomial(probs, 1, generator=generator).view(1)
        else:
            new = logits.argmax(dim=-1)
        out.append(int(new))
        if out[-1] in model.config.eos_token_id:
            break
    return out


def samples(model: OuroModel, checkpoint: Path, seed: int) -> list[str]:
    """One 64-token continuation (temperature 0.8, full depth) of each of `PROMPTS`."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    texts = []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        texts.append(prompt + tokenizer.decode(generate(model, ids, 64, 0.8, seed + i)))
    return texts


def plot(result: dict[str, Any], path: Path, curves: list[dict[str, Any]] | None = None) -> bool:
    """eval.png: loss per loop, depth histograms (min_loops 1 and 2) and, if given, the stage-1
    training loss per loop. Returns False (and plots nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no eval.png", flush=True)
        return False
    loops = list(range(1, len(result["val_loss_per_loop"]) + 1))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0, 0]
    ax.plot(loops, result["val_loss_per_loop"], marker="o")
    ax.set(
        title="Validation loss per loop", xlabel="loop", ylabel="loss (nats/token)", xticks=loops
    )
    width = 0.8 / len(THRESHOLDS)
    for ax, min_loops in zip((axes[0, 1], axes[1, 0]), MIN_LOOPS, strict=True):
        rows = [e for e in result["exit"] if e["min_loops"] == min_loops]
        for i, row in enumerate(rows):
            xs = [x + (i - (len(rows) - 1) / 2) * width for x in loops]
            label = f"q={row['threshold']} (mean {row['mean_depth']:.2f})"
            ax.bar(xs, row["depth_fraction"], width=width, label=label)
        ax.set(
            title=f"Exit depth, min_loops={min_loops}",
            xlabel="exit loop",
            ylabel="fraction of tokens",
            xticks=loops,
            ylim=(0, 1),
        )
        ax.legend()
    ax = axes[1, 1]
    stage1 = [c for c in curves or [] if c["stage"] == 1]
    if stage1:
        for t in range(len(loops)):
            ax.plot(
                [c["step"] for c in stage1],
                [c["loss_per_loop"][t] for c in stage1],
                label=f"loop {t + 1}",
            )
        ax.set(title="Training loss per loop (stage 1)", xlabel="step", ylabel="loss")
        ax.legend()
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def summary_line(result: dict[str, Any]) -> str:
    """One line: loss per loop, then mean depth at each threshold for each min_loops."""
    losses = " ".join(f"{x:.3f}" for x in result["val_loss_per_loop"])
    depths = "; ".join(
        f"min_loops={m}: "
        + " ".join(
            f"q{e['threshold']}={e['mean_depth']:.2f}"
            for e in result["exit"]
            if e["min_loops"] == m
        )
        for m in MIN_LOOPS
    )
    return f"val loss per loop {losses} | mean exit depth {depths}"


def run_evaluation(
    checkpoint: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    device: torch.device,
    seq_len: int,
    batch_size: int,
    max_windows: int = 0,
    seed: int = 0,
    curves: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load `checkpoint` (bf16 on CUDA, fp32 on CPU), evaluate, write eval.json and eval.png."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(checkpoint, dtype=dtype, device=device)
    losses, gates = collect(
        model, load_tokens(data_dir / "val.bin", device), seq_len, batch_size, max_windows
    )
    result = {
        "checkpoint": str(checkpoint),
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq_len,
        **summarize(losses, gates),
        "samples": samples(model, checkpoint, seed),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out_dir / "eval.png", curves)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True, help="holds val.bin")
    parser.add_argument("--out-dir", type=Path, help="default: the checkpoint's parent")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-windows", type=int, default=0, help="0: every val window")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text samples")
    args = parser.parse_args()
    result = run_evaluation(
        args.checkpoint,
        args.data_dir,
        args.out_dir or args.checkpoint.parent,
        device=torch.device(args.device),
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_windows=args.max_windows,
        seed=args.seed,
    )
    print("\n".join(result["samples"]), flush=True)
    print(summary_line(result), flush=True)


if __name__ == "__main__":
    main()
