"""The two training stages of the embedded Ouro model (see train.py for the recipe).

Both run teacher-forced over B random windows of S tokens (looped_lm), under bf16 autocast on
CUDA (fp32 on the CPU), with the gate in fp32. Statistics stay on the device between log
steps, so the only host syncs are the log lines and the step-time calibration.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from rlt_models import OuroModel

from looped_lm import exit_log_distribution, gate_logits, loop_losses, loop_states, windows

# Stage-1 entropy bonus (a uniform 4-way exit has entropy ln 4 = 1.39). 0.1 rather than 0.05:
# in a CPU pilot (same seed and batches, 240 steps) it kept p(t) more spread and gave 0.02-0.07
# lower validation loss on every loop (README, "Choices").
BETA = 0.1
EXIT_K, EXIT_GAMMA = 50.0, 0.005  # stage-2 continuation label sigmoid(k (I_t - gamma))
WEIGHT_DECAY = 0.1  # on the projection matrices and the LM head only
MIN_LR_FRACTION = 0.1
EVAL_RESERVE_S = 45.0  # export, reload, evaluation, samples and plot, with slack
STAGE2_STEP_COST = 0.5  # stage-2 step time / stage-1 step time (forward only; conservative)
CALIBRATION = (10, 30)  # stage-1 steps between which the step time is measured


@dataclass
class StageResult:
    """What one stage did: steps (asked, planned after the calibration, done), tokens, wall
    time, whether the time limit cut it short (by re-planning or at the deadline), the
    calibrated throughput and the logged curves."""

    steps_requested: int
    steps_planned: int
    steps_done: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    stopped_early: bool = False
    measured_tokens_per_s: float | None = None
    curves: list[dict[str, Any]] = field(default_factory=list)


class StageLog:
    """Sums per-step stats on the device (no sync per step); every `every` steps, prints their
    means with the throughput and records them in `result.curves`."""

    def __init__(
        self,
        stage: int,
        loops: int,
        tokens_per_step: int,
        every: int,
        device: torch.device,
        result: StageResult,
    ) -> None:
        self.stage, self.loops, self.every, self.device = stage, loops, every, device
        self.tokens_per_step, self.result = tokens_per_step, result
        self.stats = torch.zeros(2 * loops + 1, device=device)
        self.begin = self.last_time = time.monotonic()
        self.last_step = 0

    def add(self, losses: torch.Tensor, exits: torch.Tensor, objective: torch.Tensor) -> None:
        """losses, exits [T] (mean loss, mean exit probability per loop), objective []."""
        self.stats += torch.cat([losses, exits, objective.reshape(1)]).detach()

    def step_done(self, step: int, total: int, lr: float) -> None:
        """Log after `step` steps if it is a multiple of `every` or the last of `total`."""
        if step % self.every and step != total:
            return
        synchronize(self.device)
        now = time.monotonic()
        mean = (self.stats / (step - self.last_step)).tolist()
        losses, exits, objective = mean[: self.loops], mean[self.loops : -1], mean[-1]
        speed = (step - self.last_step) * self.tokens_per_step / (now - self.last_time)
        self.result.curves.append(
            {
                "stage": self.stage,
                "step": step,
                "objective": round(objective, 4),
                "loss_per_loop": [round(x, 4) for x in losses],
                "exit_per_loop": [round(x, 4) for x in exits],
                "lr": lr,
            }
        )
        print(
            f"stage {self.stage} step {step:5d}/{total} obj {objective:.4f} | loss/loop "
            + " ".join(f"{x:.3f}" for x in losses)
            + (" | p(t) " if self.stage == 1 else " | lambda ")
            + " ".join(f"{x:.2f}" for x in exits)
            + f" | lr {lr:.2e} | {speed:,.0f} tok/s | {now - self.begin:.0f} s",
            flush=True,
        )
        self.stats.zero_()
        self.last_time, self.last_step = now, step

    def finish(self, step: int) -> None:
        """Record the stage's totals; it stopped early if the time budget cut any step."""
        synchronize(self.device)
        self.result.steps_done, self.result.tokens = step, step * self.tokens_per_step
        self.result.stopped_early = step < self.result.steps_requested
        self.result.wall_s = time.monotonic() - self.begin


def learning_rate(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to MIN_LR_FRACTION * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def sample_starts(
    steps: int, batch: int, tokens: torch.Tensor, seq_len: int, seed: int
) -> torch.Tensor:
    """Window starts [steps, batch] drawn on the CPU from a seeded generator, moved once."""
    generator = torch.Generator().manual_seed(seed)
    high = tokens.numel() - seq_len - 1
    return torch.randint(0, high, (steps, batch), generator=generator).to(tokens.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_stage1(
    model: OuroModel, tokens: torch.Tensor, args: argparse.Namespace, end_time: float
) -> StageResult:
    """Ouro objective on all parameters. Re-plans its length from the step time measured at
    CALIBRATION, and stops at the deadline that keeps stage 2 and the evaluation in budget."""
    device, batch, seq = tokens.device, args.batch_size, args.seq_len
    result = StageResult(args.steps_stage1, steps_planned=args.steps_stage1)
    log = StageLog(1, model.shape.num_loops, batch * seq, args.log_every, device, result)
    named = list(model.named_parameters())
    for _, p in named:
        p.requires_grad_(True)
    decayed = {n for n, p in named if p.ndim == 2} - {"embed_tokens", "early_exit_gate_weight"}
    groups = [
        {"params": [p for n, p in named if n in decayed], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    starts = sample_starts(args.steps_stage1, batch, tokens, seq, args.seed + 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    deadline = end_time - EVAL_RESERVE_S
    calibration_start = time.monotonic()
    step = 0
    while step < result.steps_planned:
        if time.monotonic() >= deadline:
            print(f"stage 1: time limit reached after {step} steps", flush=True)
            break
        rows = windows(tokens, starts[step], seq)
        with autocast:
            states = loop_states(model, rows[:, :-1])
            losses = loop_losses(model, states, rows[:, 1:])
        log_p = exit_log_distribution(gate_logits(model, states))
        p = log_p.exp()
        objective = (p * losses).sum(0).mean() + args.beta * (p * log_p).sum(0).mean()
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        warmup = min(args.warmup_steps, max(1, result.steps_planned // 10))
        lr = learning_rate(step, result.steps_planned, warmup, args.lr)
        set_lr(optimizer, lr)
        optimizer.step()
        log.add(losses.mean(1), p.mean(1), objective)
        step += 1
        if step == CALIBRATION[0]:
            synchronize(device)
            calibration_start = time.monotonic()
        elif step == CALIBRATION[1]:
            synchronize(device)
            step_s = (time.monotonic() - calibration_start) / (CALIBRATION[1] - CALIBRATION[0])
            result.measured_tokens_per_s = batch * seq / step_s
            deadline -= args.steps_stage2 * step_s * STAGE2_STEP_COST
            fit = step + int((deadline - time.monotonic()) / step_s)
            result.steps_planned = max(step, min(args.steps_stage1, fit))
            print(
                f"measured {result.measured_tokens_per_s:,.0f} tok/s ({step_s * 1e3:.1f} "
                f"ms/step): stage 1 plans {result.steps_planned} of {args.steps_stage1} "
                f"steps, ~{result.steps_planned * step_s:.0f} s",
                flush=True,
            )
        log.step_done(step, result.steps_planned, lr)
    log.finish(step)
    return result


def train_stage2(
    model: OuroModel, tokens: torch.Tensor, args: argparse.Namespace, end_time: float
) -> StageResult:
    """Gate-only training on the loss improvement between loops (Ouro's adaptive-exit stage)."""
    device, batch, seq = tokens.device, args.batch_size, args.seq_len
    result = StageResult(args.steps_stage2, steps_planned=args.steps_stage2)
    log = StageLog(2, model.shape.num_loops, batch * seq, args.log_every, device, result)
    for p in model.parameters():
        p.requires_grad_(False)
    gate = [model.early_exit_gate_weight, model.early_exit_gate_bias]
    for p in gate:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(gate, lr=args.gate_lr, weight_decay=0.0)
    starts = sample_starts(args.steps_stage2, batch, tokens, seq, args.seed + 2)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    step = 0
    while step < args.steps_stage2:
        if time.monotonic() >= end_time - EVAL_RESERVE_S:
            print(f"stage 2: time limit reached after {step} steps", flush=True)
            break
        rows = windows(tokens, starts[step], seq)
        with torch.no_grad(), autocast:
            states = loop_states(model, rows[:, :-1])
            losses = loop_losses(model, states, rows[:, 1:])
        improvement = (losses[:-1] - losses[1:]).clamp_min(0.0)
        target_exit = 1.0 - torch.sigmoid(EXIT_K * (improvement - EXIT_GAMMA))
        logits = gate_logits(model, states[:-1])
        objective = F.binary_cross_entropy_with_logits(logits, target_exit)
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        lr = learning_rate(step, args.steps_stage2, max(1, args.steps_stage2 // 20), args.gate_lr)
        set_lr(optimizer, lr)
        optimizer.step()
        log.add(losses.mean(1), F.pad(torch.sigmoid(logits).mean(1), (0, 1)), objective)
        step += 1
        log.step_done(step, args.steps_stage2, lr)
    log.finish(step)
    return result
