"""Scheduler counters (monotonic; written only by the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt positions computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    decode_loops: int = 0  # loops run for output tokens 1.. (token 0 comes from prefill)
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0
    resumptions: int = 0
    decode_ticks: int = 0  # loop ticks run by the device (each runs every decoding row once)
    loop_slots: int = 0  # rows x ticks of the decode batches (padding rows included)
