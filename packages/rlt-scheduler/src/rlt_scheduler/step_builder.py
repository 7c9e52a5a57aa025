"""`StepBuilder`: collects the items of one step under the token budget, then freezes them."""

from __future__ import annotations

from rlt_contracts import (
    ExecutionIdentity,
    NewRequestData,
    PrefillChunk,
    RequestBlocks,
    SchedulerOutput,
    TokenMask,
)


class StepBuilder:
    """Mutable draft of one `SchedulerOutput`; lives only while one step is being scheduled (R03).

    token_budget: token rows left per tick (a decoding row and a prefill token each cost one).
    loop_budget: token x loop passes left (decoding row 1, prefill token `depth`); None = no cap.
    output_bounds: per request, the most outputs this step can produce (KV lookahead accounting).
    looping_room: a speculative step's room for requests that start decoding in it (a prompt
      completing, a PD remote start, a resumed decoding request); None: unlimited.
    start_deferred: a request that could have started decoding waited for lack of room.
    """

    def __init__(self, token_budget: int, loop_budget: int | None, depth: int) -> None:
        self.token_budget = token_budget
        self.loop_budget = loop_budget
        self.depth = depth
        self.snapshots: list[ExecutionIdentity] = []
        self.restores: list[ExecutionIdentity] = []
        self.new_requests: list[NewRequestData] = []
        self.block_updates: list[RequestBlocks] = []
        self.prefill: list[PrefillChunk] = []
        self.decoding: list[ExecutionIdentity] = []
        self.remote_starts: list[ExecutionIdentity] = []
        self.output_bounds: dict[ExecutionIdentity, int] = {}
        self.token_masks: list[TokenMask] = []
        self.selected: set[ExecutionIdentity] = set()
        self.looping_room: int | None = None
        self.start_deferred = False

    def can_start_decoding(self) -> bool:
        """Whether one more request may start decoding in this step; False records that a
        start waited."""
        if self.looping_room is None or self.looping_room > 0:
            return True
        self.start_deferred = True
        return False

    def take_looping_row(self) -> bool:
        """`can_start_decoding`, and if so the room is taken."""
        if not self.can_start_decoding():
            return False
        if self.looping_room is not None:
            self.looping_room -= 1
        return True

    def prefill_room(self) -> int:
        """Prompt tokens that still fit this step under both budgets."""
        room = self.token_budget
        if self.loop_budget is not None:
            room = min(room, self.loop_budget // self.depth)
        return max(room, 0)

    def add_decode(self, identity: ExecutionIdentity, output_bound: int) -> None:
        self._add_row(self.decoding, identity, output_bound)

    def add_remote_start(self, identity: ExecutionIdentity, output_bound: int) -> None:
        """A PD decode request whose prompt KV landed: token 0 plus this step's ticks."""
        self._add_row(self.remote_starts, identity, output_bound)

    def _add_row(self, rows: list, identity: ExecutionIdentity, output_bound: int) -> None:
        """One looping row: one token and one token-loop of the budgets."""
        rows.append(identity)
        self.selected.add(identity)
        self.output_bounds[identity] = output_bound
        self.token_budget -= 1
        if self.loop_budget is not None:
            self.loop_budget -= 1

    def add_prefill(self, chunk: PrefillChunk, output_bound: int) -> None:
        self.prefill.append(chunk)
        self.selected.add(chunk.identity)
        if output_bound:
            self.output_bounds[chunk.identity] = output_bound
        self.token_budget -= len(chunk.token_ids)
        if self.loop_budget is not None:
            self.loop_budget -= len(chunk.token_ids) * self.depth

    def build(
        self,
        step_id: int,
        *,
        released: tuple[ExecutionIdentity, ...],
        decode_ticks: int,
        speculative_rounds: int = 0,
    ) -> SchedulerOutput:
        return SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(self.new_requests),
            block_updates=tuple(self.block_updates),
            released=released,
            snapshots=tuple(self.snapshots),
            restores=tuple(self.restores),
            prefill=tuple(self.prefill),
            remote_starts=tuple(self.remote_starts),
            decode_ticks=decode_ticks,
            token_masks=tuple(self.token_masks),
            speculative_rounds=speculative_rounds,
        )
