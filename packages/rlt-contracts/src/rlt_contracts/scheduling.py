"""`SchedulerOutput`: what one engine step executes, as decided by the scheduler (M3).

One step may hold prefill chunks, codas and one recurrent loop for every decoding row. The runner
executes them in this order, which every consumer may rely on:

1. `kv_copies`: LAST_EXITED finalization of tokens that exited early (on the blocks their
   requests hold on the device, including requests preempted in this same step).
2. `snapshots`: preempted requests' device state is saved to the host and their slots freed
   (their blocks may be reused by later work of this same step).
3. `released`: device state (and any snapshot) of finished / aborted requests is dropped.
4. `new_requests` and `restores` get slots, `block_updates` are applied, then restored requests
   get their saved state back in their new blocks.
5. `prefill`: prompt chunks at full depth. A chunk with `completes_prompt` leaves its final hidden
   state for coda (Ouro: the last prompt position never loops again).
6. `coda`: LM head + sampling for exited tokens and completed prompts; the sampled token becomes
   the request's pending token on the device (it is not read back before it is used).
7. `decode`: one loop per row; rows with `starts_token` first embed their pending token (prelude).

Positions are 0-based token positions: the prompt occupies [0, P); generated token i is fed back
at position P + i. Loop indices are 1-based (loop 1 .. T). A position never changes across loops.
"""

from __future__ import annotations

import msgspec

from rlt_contracts.kv import BlockTableUpdate
from rlt_contracts.requests import ExecutionIdentity
from rlt_contracts.sampling import SamplingParams


class NewRequestData(msgspec.Struct, frozen=True):
    """Sent once, the first step a request is scheduled after admission (not after a restore).

    sampling: the request's parameters with `seed` resolved (never None here).
    prompt_length: number of prompt tokens P.
    """

    identity: ExecutionIdentity
    sampling: SamplingParams
    prompt_length: int


class PrefillChunk(msgspec.Struct, frozen=True):
    """Prompt positions [start_position, start_position + len(token_ids)) at full depth."""

    identity: ExecutionIdentity
    start_position: int
    token_ids: tuple[int, ...]
    completes_prompt: bool

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


class KVCopyPlan(msgspec.Struct, frozen=True, array_like=True):
    """Copy the KV of `position` (all layers) from `source_plane` into `target_planes`."""

    identity: ExecutionIdentity
    position: int
    source_plane: int
    target_planes: tuple[int, ...]


class CodaItem(msgspec.Struct, frozen=True, array_like=True):
    """Run the LM head on the exited hidden state of `position` and sample output `output_index`.

    exit_depth: loops the hidden state went through (reported with the token).
    """

    identity: ExecutionIdentity
    position: int
    output_index: int
    exit_depth: int


class DecodeLoop(msgspec.Struct, frozen=True, array_like=True):
    """Run loop `loop_index` (1-based) for the token at `position`.

    starts_token: the row first embeds its pending sampled token (prelude), then runs loop 1.
    """

    identity: ExecutionIdentity
    position: int
    loop_index: int
    starts_token: bool


class RequestBlocks(msgspec.Struct, frozen=True, array_like=True):
    """Block-table growth of one request, applied by the runner before anything executes."""

    identity: ExecutionIdentity
    updates: tuple[BlockTableUpdate, ...]


class SchedulerOutput(msgspec.Struct, frozen=True):
    """Everything one engine step executes. Immutable; built by the scheduler only.

    step_id: engine-unique, increasing; echoed in `ModelRunnerOutput.step_id`.
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    block_updates: tuple[RequestBlocks, ...] = ()
    released: tuple[ExecutionIdentity, ...] = ()
    snapshots: tuple[ExecutionIdentity, ...] = ()
    restores: tuple[ExecutionIdentity, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    kv_copies: tuple[KVCopyPlan, ...] = ()
    coda: tuple[CodaItem, ...] = ()
    decode: tuple[DecodeLoop, ...] = ()
    compute_gates: bool = True

    @property
    def has_work(self) -> bool:
        """True if the runner must execute model work (not only bookkeeping)."""
        return bool(self.prefill or self.coda or self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.prefill)
