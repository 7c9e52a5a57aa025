"""Prompt logprobs (`SamplingParams.prompt_logprobs`) from a chunk's per-position states.

A scored chunk runs eagerly: at full depth prefill.py keeps its positions' final states; at each
position's exit depth (`score_at_exit_depth`) exit_depth_prefill.py gives their exit states and
depths. Here those states go through the LM head, and position p, whose state has seen tokens
0..p, scores prompt token p + 1 (the last prompt position scores nothing: it samples token 0).
Per chunk the device computes log_softmax in fp32, gathers the next tokens' log-probabilities
and the top n, and packs them as fp64 rows [logprob, rank, n top logprobs, n top ids(, exit
depth)] (exact integers) into one download that the step's read-back collects with the rest
(no extra wait).

Worked example: a 7-token prompt in chunks [0, 4) and [4, 7) scores tokens 1..4 with the first
chunk's states 0..3 and tokens 5..6 with the second's states 4..5; the response reports
[None, lp1, ..., lp6].
"""

from __future__ import annotations

import torch
from rlt_contracts import ExecutionIdentity, LoopedLanguageModel, PromptLogprobs

from rlt_runner.row_record import RowRecord
from rlt_runner.transfers import download, upload

# positions scored per LM-head call: their fp32 log-probabilities ([rows, V], 25 MB per 128 rows
# at Ouro's 49,152 tokens) stay within what the memory profile's prefill chunk leaves
SLICE_ROWS = 128


def score_chunk(
    model: LoopedLanguageModel,
    states: torch.Tensor,
    record: RowRecord,
    start: int,
    *,
    exit_depths: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor] | None:
    """(first scored token, packed host rows on their way) for one chunk's `states` [len, d]
    at positions [start, start + len) (their exit depths [len] int64 when scored at exit
    depth, packed as the last column); None if it scores nothing."""
    end = min(start + states.shape[0], record.prompt_length - 1)
    if end <= start:
        return None
    targets = upload(list(record.prompt_token_ids[start + 1 : end + 1]), torch.int64, states.device)
    top = record.sampling.prompt_logprobs
    rows = []
    for first in range(0, end - start, SLICE_ROWS):  # bounded fp32 [rows, V] temporaries
        last = min(first + SLICE_ROWS, end - start)
        logprobs = torch.log_softmax(model.coda(states[first:last]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[first:last, None])
        columns = [chosen, (logprobs > chosen).sum(dim=1, keepdim=True) + 1]
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            columns += [values, ids]
        if exit_depths is not None:
            columns.append(exit_depths[first:last, None])
        rows.append(torch.cat([c.double() for c in columns], dim=1))
    return start + 1, download(torch.cat(rows) if len(rows) > 1 else rows[0])


def unpack(
    identity: ExecutionIdentity,
    first_token: int,
    host: torch.Tensor,
    top: int,
    *,
    with_exit_depths: bool = False,
) -> PromptLogprobs:
    """The downloaded rows of `score_chunk` as the contract's `PromptLogprobs`."""
    rows = host.tolist()
    return PromptLogprobs(
        identity=identity,
        first_token=first_token,
        token_logprobs=tuple(row[0] for row in rows),
        token_ranks=tuple(int(row[1]) for row in rows),
        top_logprobs=tuple(
            tuple(zip((int(i) for i in row[2 + top : 2 + 2 * top]), row[2 : 2 + top], strict=True))
            for row in rows
        ),
        exit_depths=tuple(int(row[-1]) for row in rows) if with_exit_depths else (),
    )
