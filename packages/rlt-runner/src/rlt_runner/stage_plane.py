"""The stage plane: KV of a family's layers outside its recurrent block (`KVPlan.stage_layers`).

A family such as Dory runs prelude layers once per token before its loops and coda layers once
after them, each attending over its own KV (one slot per layer, kept on one more plane after the
loop planes). In a decode tick the prelude and the coda are computed for every row (a fixed
shape keeps the tick capturable) but write only where the row runs them:

    tick t:    prelude (rows starting a token: loops == 0)  ->  one loop  ->  exits
               -> coda (rows that exit) -> head -> sample

A token's prelude runs in the tick of its first loop, at its own position, whose page the
scheduler has allocated for that loop anyway. Rows that do not run a stage write to the scratch
slot and read one key (their result is discarded).
"""

from __future__ import annotations

import torch
from rlt_contracts import PagedAttentionBatch

from rlt_runner.kv_storage import KVStorage
from rlt_runner.row_state import DecodeRows


class StagePlane:
    def __init__(self, kv: KVStorage, rows: DecodeRows, query_start: torch.Tensor) -> None:
        if rows.stage_plane is None:
            raise ValueError("these rows keep no stage plane")
        self.kv = kv
        self.rows = rows
        self.index = rows.stage_plane
        self.query_start = query_start

    def tick_batch(
        self, num_rows: int, position: torch.Tensor, writes: torch.Tensor, max_context: int
    ) -> PagedAttentionBatch:
        """One query per row at `position` [B] on the stage plane; rows `writes` [B] bool store
        their keys at their own slot and read their context, the others neither."""
        B, block_size = num_rows, self.kv.block_size
        tables = self.rows.block_tables[:B, self.index]
        page = torch.clamp(position // block_size, max=tables.shape[1] - 1)
        slot = tables.gather(1, page[:, None]).squeeze(1).to(torch.int64) * block_size
        slot = slot + position % block_size
        return PagedAttentionBatch(
            query_start=self.query_start[: B + 1],
            context_lengths=torch.where(writes, position + 1, 1).to(torch.int32),
            block_tables=tables,
            write_slots=torch.where(writes, slot, self.kv.scratch_slot),
            max_query_len=1,
            max_context_len=max_context,
        )
