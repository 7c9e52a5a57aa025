"""`RequestSlots`: device state that persists across steps for each running request.

Each running request (by execution identity) owns one slot index into persistent buffers:
  hidden        [S, d]            the normed state after its latest loop (carried across steps)
  pending_token [S] int64         its latest sampled token, consumed on the device by the prelude
  block_tables  [S, planes, pages] int32 physical block of every logical page of every plane
plus a host copy of its block tables and its sampling parameters. Written only by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rlt_contracts import BlockTableUpdate, ExecutionIdentity, SamplingParams


@dataclass
class SlotState:
    slot: int
    sampling: SamplingParams
    host_tables: list[list[int]] = field(default_factory=list)


class RequestSlots:
    def __init__(
        self,
        *,
        max_requests: int,
        num_planes: int,
        max_pages: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_planes = num_planes
        self.hidden = torch.zeros(max_requests, hidden_size, dtype=dtype, device=device)
        self.pending_token = torch.zeros(max_requests, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            max_requests, num_planes, max_pages, dtype=torch.int32, device=device
        )
        self._free = list(range(max_requests - 1, -1, -1))
        self._states: dict[ExecutionIdentity, SlotState] = {}

    def __contains__(self, identity: ExecutionIdentity) -> bool:
        return identity in self._states

    def __len__(self) -> int:
        return len(self._states)

    def identities(self) -> list[ExecutionIdentity]:
        return list(self._states)

    def state(self, identity: ExecutionIdentity) -> SlotState:
        try:
            return self._states[identity]
        except KeyError:
            raise RuntimeError(f"runner has no state for {identity}") from None

    def assign(self, identity: ExecutionIdentity, sampling: SamplingParams) -> SlotState:
        if identity in self._states:
            raise RuntimeError(f"{identity} already has a runner slot")
        if not self._free:
            raise RuntimeError("no free runner slot (more running requests than max_num_seqs)")
        state = SlotState(self._free.pop(), sampling, [[] for _ in range(self.num_planes)])
        self._states[identity] = state
        return state

    def release(self, identity: ExecutionIdentity) -> None:
        state = self._states.pop(identity, None)
        if state is not None:
            self._free.append(state.slot)

    def apply_block_updates(
        self, identity: ExecutionIdentity, updates: tuple[BlockTableUpdate, ...]
    ) -> None:
        state = self.state(identity)
        for update in updates:
            table = state.host_tables[update.plane]
            del table[update.first_page :]
            table.extend(update.block_ids)
            if update.block_ids:
                end = update.first_page + len(update.block_ids)
                values = torch.tensor(update.block_ids, dtype=torch.int32)
                self.block_tables[state.slot, update.plane, update.first_page : end] = values.to(
                    self.block_tables.device, non_blocking=True
                )

    def slot_of_position(
        self, identity: ExecutionIdentity, plane: int, position: int, block_size: int
    ) -> int:
        """Flat KV slot of `position` at `plane` (host arithmetic on the host tables)."""
        table = self.state(identity).host_tables[plane]
        return table[position // block_size] * block_size + position % block_size
