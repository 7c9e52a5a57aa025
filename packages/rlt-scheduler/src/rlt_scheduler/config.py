"""Scheduler configuration (caller settings, never mutated at run time)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlt_contracts import ConfigurationError


class SchedulingMode(enum.StrEnum):
    """How new tokens join the recurrent batch.

    REFILL     a token that exits is sampled in the next step and its successor starts loop 1
               right away, next to other rows at any depth (default).
    NO_REFILL  the rows decoding together form a cohort; exited rows wait until the whole cohort
               has exited, then all sample and the next cohort starts loop 1 together.
    """

    REFILL = "refill"
    NO_REFILL = "no_refill"


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    max_num_seqs: requests holding KV and runner state at once (decode rows per step <= this).
    max_num_batched_tokens: token rows per step through the recurrent stack: one per decoding
      request plus every prefill-chunk token (each prefill token then runs all T loops).
    prefill_chunk_size: at most this many prompt tokens of one request per step.
    max_waiting_requests: waiting-queue bound; `add_request` beyond it raises OverloadedError.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    prefill_chunk_size: int = 128
    mode: SchedulingMode = SchedulingMode.REFILL
    max_waiting_requests: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size",
                     "max_waiting_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(name, f"must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ConfigurationError(
                ("max_num_batched_tokens", "max_num_seqs"),
                f"the token budget ({self.max_num_batched_tokens}) must exceed the number of "
                f"decode rows ({self.max_num_seqs}) so prefill always progresses",
            )
        try:
            object.__setattr__(self, "mode", SchedulingMode(self.mode))
        except ValueError:
            raise ConfigurationError(
                "scheduling_mode", f"must be one of {[m.value for m in SchedulingMode]}, got {self.mode!r}"
            ) from None
