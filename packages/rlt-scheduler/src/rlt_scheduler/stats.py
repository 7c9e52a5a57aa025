"""Scheduler counters (monotonic; written only by the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_contracts import SpeculationCounts


@dataclass
class SchedulerStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt positions computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    decode_loops: int = 0  # loops run for output tokens 1.. (token 0 comes from prefill)
    decoded_tokens: int = 0  # output tokens 1.. recorded (what decode_loops is divided by)
    early_exit_tokens: int = 0  # of those, tokens that exited before their rule's max_loops
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0
    resumptions: int = 0
    decode_ticks: int = 0  # loop ticks run by the device (each runs every decoding row once)
    loop_slots: int = 0  # rows x ticks of the decode batches (padding rows included)
    spec_drafts: int = 0  # (request, round) pairs that drafted (speculative decoding)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    def add_speculation(self, counts: SpeculationCounts) -> None:
        """Add one step's draft and acceptance counts."""
        self.spec_drafts += counts.drafts
        self.spec_draft_tokens += counts.draft_tokens
        self.spec_accepted_tokens += counts.accepted_tokens
        per_position = self.spec_accepted_per_position
        per_position.extend([0] * (len(counts.accepted_per_position) - len(per_position)))
        for position, accepted in enumerate(counts.accepted_per_position):
            per_position[position] += accepted
