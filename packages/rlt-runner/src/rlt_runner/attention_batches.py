"""Builds `PagedAttentionBatch` metadata on the device from per-row host descriptions.

Two shapes occur:
- decode rows: one query each, at its own plane (rows at different loop depths mix freely);
- prefill groups: a run of consecutive prompt positions of one request at one plane.
Block-table rows are gathered on the device from the persistent [slots, planes, pages] buffer;
only small index lists travel from the host, once per model call.
"""

from __future__ import annotations

import torch
from rlt_contracts import PagedAttentionBatch

from rlt_runner.request_slots import RequestSlots


def decode_batch(
    slots: RequestSlots,
    slot_ids: torch.Tensor,
    planes: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_size: int,
    max_position: int,
) -> PagedAttentionBatch:
    """One query per row. slot_ids / planes / positions: [R] int64 on the device;
    max_position: the largest position (host int) bounding the pages read."""
    rows = slot_ids.shape[0]
    pages = max_position // block_size + 1
    tables = slots.block_tables[slot_ids, planes, :pages]
    write_blocks = tables.gather(1, (positions // block_size)[:, None]).squeeze(1).long()
    return PagedAttentionBatch(
        query_start=torch.arange(rows + 1, dtype=torch.int32, device=slot_ids.device),
        context_lengths=(positions + 1).to(torch.int32),
        block_tables=tables,
        write_slots=write_blocks * block_size + positions % block_size,
        max_query_len=1,
        max_context_len=max_position + 1,
    )


def prefill_batch(
    slots: RequestSlots,
    slot_ids: list[int],
    plane: int,
    starts: list[int],
    lengths: list[int],
    *,
    block_size: int,
    device: torch.device,
) -> PagedAttentionBatch:
    """Groups of consecutive positions [start, start + length) of one request each, all read at
    `plane`. Query rows are packed in group order."""
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    max_end = max(ends)
    pages = (max_end - 1) // block_size + 1
    slot_index = torch.tensor(slot_ids, dtype=torch.long, device=device)
    tables = slots.block_tables[slot_index, plane, :pages]
    positions = torch.cat(
        [torch.arange(s, e, dtype=torch.long) for s, e in zip(starts, ends, strict=True)]
    ).to(device)
    group_of_row = torch.repeat_interleave(torch.arange(len(slot_ids)), torch.tensor(lengths)).to(
        device
    )
    write_blocks = tables[group_of_row, positions // block_size].long()
    query_start = [0]
    for n in lengths:
        query_start.append(query_start[-1] + n)
    return PagedAttentionBatch(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_lengths=torch.tensor(ends, dtype=torch.int32, device=device),
        block_tables=tables,
        write_slots=write_blocks * block_size + positions % block_size,
        max_query_len=max(lengths),
        max_context_len=max_end,
    )
