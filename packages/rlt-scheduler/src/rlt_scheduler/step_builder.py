"""`StepBuilder`: collects the items of one step under the token budget, then freezes them."""

from __future__ import annotations

from rlt_contracts import (
    CodaItem,
    DecodeLoop,
    ExecutionIdentity,
    KVCopyPlan,
    NewRequestData,
    PrefillChunk,
    RequestBlocks,
    SchedulerOutput,
)


class StepBuilder:
    """Mutable draft of one `SchedulerOutput`; lives only while one step is being scheduled (R03).

    token_budget: token rows left this step (decode rows and prefill tokens each cost one).
    """

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.new_requests: list[NewRequestData] = []
        self.block_updates: list[RequestBlocks] = []
        self.prefill: list[PrefillChunk] = []
        self.kv_copies: list[KVCopyPlan] = []
        self.coda: list[CodaItem] = []
        self.decode: list[DecodeLoop] = []
        self.selected: set[ExecutionIdentity] = set()

    def add_decode(self, item: DecodeLoop) -> None:
        self.decode.append(item)
        self.selected.add(item.identity)
        self.token_budget -= 1

    def add_prefill(self, chunk: PrefillChunk) -> None:
        self.prefill.append(chunk)
        self.selected.add(chunk.identity)
        self.token_budget -= len(chunk.token_ids)

    def add_coda(self, item: CodaItem) -> None:
        self.coda.append(item)
        self.selected.add(item.identity)

    def build(
        self,
        step_id: int,
        *,
        released: tuple[ExecutionIdentity, ...],
        compute_gates: bool,
    ) -> SchedulerOutput:
        return SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(self.new_requests),
            block_updates=tuple(self.block_updates),
            released=released,
            prefill=tuple(self.prefill),
            kv_copies=tuple(self.kv_copies),
            coda=tuple(self.coda),
            decode=tuple(self.decode),
            compute_gates=compute_gates,
        )
