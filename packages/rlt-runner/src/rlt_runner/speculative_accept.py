"""Accepting a speculative round (the end of `SpeculativeProgram.round`; README.md,
"Speculative rounds"): the coda of every position at its exit depth, the sampler's
`verify_rows` (or, in the benchmarks, the forced accepted counts), then the round's effects:
the emitted tokens (the accepted drafts and one more, cut after the first stop id or at
max_tokens; none for a row that is not live), their records and output counts, and the rows'
new state (live rows continue at position p + emitted with the last token embedded and a fresh
exit state, or stop; other rows get their own values back).
"""

from __future__ import annotations

import torch
from rlt_contracts import SamplingMode

from rlt_runner.decode_program import record_columns, record_values
from rlt_runner.speculative_state import RoundState, Slots


def accept_round(program: RoundState, slots: Slots, mode: SamplingMode) -> None:
    """Coda of every position at its exit depth, the sampler's verification, the round's
    records and counts, and the rows' new state."""
    rows, n, width = program.rows, slots.count, program.width
    index = slots.index
    override = None
    if program.forcing:
        override = program.forced_accepted.index_select(0, program.round_index)[0, :n]
    result = program.sampler.verify_rows(
        program.model.coda(program.hidden[:n].reshape(n * width, -1)),
        draft_tokens=program.token[:n, 1:],
        draft_probabilities=program.draft_probabilities_buffer()[:n] if mode.random else None,
        drafted=slots.drafted,
        counter=slots.outputs,
        mode=mode,
        accepted_override=override,
        **rows.sampling_keywords(index, mode),
    )
    tokens, offsets = result.token_ids, program.offsets
    is_stop = (tokens[:, :, None] == rows.stop_ids[index][:, None, :]).any(dim=2)
    at_max = slots.outputs[:, None] + offsets + 1 >= rows.max_tokens[index][:, None]
    ends = (is_stop | at_max) & (offsets <= result.accepted[:, None])
    stopped = ends.any(dim=1) & slots.live
    last = torch.where(ends.any(dim=1), ends.to(torch.int32).argmax(dim=1), result.accepted)
    count = torch.where(slots.live, last + 1, 0)
    kept = offsets < count[:, None]
    _record(program, n, kept, result, mode)
    program.counts.narrow(1, 0, n).index_copy_(
        0,
        program.round_index,
        torch.stack([result.accepted, slots.drafted], dim=1).to(torch.float64)[None],
    )
    if mode.penalized:  # the counts later tokens' penalties read
        rows.logits_state.output_counts.index_put_(
            (index.repeat_interleave(width), tokens.reshape(-1)),
            kept.reshape(-1).to(torch.int32),
            accumulate=True,
        )
    final = tokens.gather(1, last[:, None]).squeeze(1)
    _commit(program, slots, final, count, stopped)


def _commit(program: RoundState, slots: Slots, final, count, stopped) -> None:
    """Write the rows' new state (only live rows change; the others get their own values
    back): the last emitted token is the next input (embedded), or the row stops."""
    rows, index, live = program.rows, slots.index, slots.live
    carry_on = live & ~stopped

    def put(buffer: torch.Tensor, value: torch.Tensor, where: torch.Tensor) -> None:
        old = buffer[index]
        mask = where.view(-1, *([1] * (old.dim() - 1)))
        buffer.index_copy_(0, index, torch.where(mask, value, old))

    put(rows.hidden, program.model.embed(final), carry_on)
    put(rows.token, final, live)
    put(rows.position, rows.position[index] + count, carry_on)
    put(rows.outputs, rows.outputs[index] + count, live)
    put(rows.loops, torch.zeros_like(count), live)
    put(rows.pending_exit, torch.zeros_like(count), live)
    put(rows.survival, torch.ones_like(rows.survival[index]), live)
    put(rows.active, ~stopped, live)
    put(rows.parked, carry_on & program.cohort, live)
    put(rows.held, rows.hold_after_output[index], carry_on)


def _record(program: RoundState, n: int, kept, result, mode) -> None:
    values = record_values(kept, program.depths[:n], result, mode).transpose(0, 1)  # [K + 1, n, c]
    target = program.round_index * program.width + program.offsets
    program.ring.narrow(1, 0, n).narrow(2, 0, record_columns(mode)).index_copy_(0, target, values)
