"""`RowRecord`: the host view of one request's row in `DecodeRows` (row_state.py).

A plain record below the modules that take it as a parameter (row_state.py, logits_state.py,
snapshots, read-backs, prompt chunks), so that none of them imports another for its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_contracts import DecodeRule, ExecutionIdentity, SamplingParams


@dataclass(eq=False)
class RowRecord:
    """Host view of one request's row. `decoding`: its prompt is done, so the row may be active
    on the device; `reported`: outputs already parsed from read-backs (the next one's index);
    `prefill_only` (PD prefill): the completed prompt's state stays in the row for transfer;
    `prompt_token_ids`: the whole prompt (read for repetition penalties only)."""

    identity: ExecutionIdentity
    row: int
    sampling: SamplingParams
    rule: DecodeRule
    prompt_length: int
    host_tables: list[list[int]] = field(default_factory=list)
    decoding: bool = False
    reported: int = 0
    prefill_only: bool = False
    prompt_token_ids: tuple[int, ...] = ()
