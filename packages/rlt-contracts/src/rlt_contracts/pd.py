"""Prefill/decode disaggregation contracts (RFC M9): roles, compatibility, the KV handoff.

Direction and timing (push, as vllm-rlt): the coordinator first admits the request on the
decode instance D, which allocates KV blocks for the prompt at every plane and a row whose
hidden-state buffer will receive the final prompt token's state, and reports them as a
`HandoffTarget`. The prefill instance P then computes the prompt at full depth in chunks; after
each chunk's device work is complete, P writes (RDMA WRITE through NIXL) that chunk's KV at every
plane into D's blocks as numbered partitions, each followed by a notification; after the last
chunk it writes the hidden state and sends a commit carrying the partition count. D activates
the request only when every sequence number and the commit have arrived (a commit alone ends
*submission*, not delivery, R18); it then runs the coda, samples token 0 and decodes.

Release rules (who frees what, when):
- P frees its blocks for the request only after every write it posted has completed locally
  (NIXL reports DONE), or failed.
- D frees the destination blocks of a completed handoff with the request, as usual. Of a
  cancelled one (client gone, abort, timeout) only when P confirmed that no write is pending or
  can start (P answers a cancel after draining), or when the handoff lease expired (P presumed
  dead). Until then the blocks stay held, so no late write can land in a block reused by another
  request; a reused request id gets a fresh transfer id, so late notifications are stale.
- Prefix hits on D: positions [0, first_token) are already valid in D's cached pages and are
  never written; the last prompt token is always computed on P (its hidden state is needed).
- Preemption: a request waiting for KV on D is never a preemption victim (its blocks are a
  remote write target); once decoding it is an ordinary request.
"""

from __future__ import annotations

import enum
from typing import Protocol

import msgspec


class PDRole(enum.StrEnum):
    """What an engine instance does in a PD deployment."""

    NONE = "none"  # a whole engine: prefill and decode
    PREFILL = "prefill"  # computes prompts and pushes their KV to decode instances
    DECODE = "decode"  # receives prompts' KV, samples token 0 and decodes


class PDCompatibility(msgspec.Struct, frozen=True):
    """What must be equal on P and D for a KV handoff to be meaningful (checked at connect).

    model_identity: a digest of the checkpoint's config and weights file names and sizes.
    block_bytes: K+V bytes of one block of one layer; hidden_bytes: one row's hidden state.
    kv_cache_dtype: the cache's element type; kv_scales: an fp8 cache's per-layer key scales
    then value scales (bytes mean the same on both sides only with equal scales).
    """

    model_identity: str
    num_layers: int
    num_loops: int
    kv_layout: str
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    hidden_bytes: int
    kv_cache_dtype: str = ""
    kv_scales: tuple[float, ...] = ()

    def mismatches(self, other: PDCompatibility) -> list[str]:
        """Names of the fields that differ, with both values (empty: compatible)."""
        return [
            f"{name}: {getattr(self, name)!r} here, {getattr(other, name)!r} there"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class HandoffTarget(msgspec.Struct, frozen=True):
    """Where P writes one request's prompt KV on D (reported by D when it admitted the request).

    transfer_id: the coordinator's id of this handoff (fresh per admission; messages of another
      id are stale).
    decode_agent: D's transport agent name.
    block_tables: D's blocks of the prompt's pages, one table per storage plane.
    first_token: positions [0, first_token) are valid on D already (cached prefix); P writes
      [first_token, prompt_length).
    hidden_row: D's row whose hidden-state buffer receives the final prompt token's state.
    prompt_length: P (number of prompt tokens).
    """

    transfer_id: str
    decode_agent: str
    block_tables: tuple[tuple[int, ...], ...]
    first_token: int
    hidden_row: int
    prompt_length: int


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The `kv_transfer_params` extension of a completion request and of D's first event.

    role "decode" (to D): admit the request and wait for its KV from P (`transfer_id`,
      `prefill_agent`); D's first stream event carries `target`.
    role "prefill" (to P): compute the prompt and push its KV to `target`; P answers once its
      writes completed (no token is generated on P).
    """

    role: PDRole
    transfer_id: str
    prefill_agent: str | None = None
    target: HandoffTarget | None = None


class HandoffEvents(msgspec.Struct, frozen=True):
    """What a handoff port observed since its last poll (transfer ids).

    sent: P: every write of the transfer completed locally; its blocks may be freed.
    landed: D: every partition and the commit arrived; the request may start decoding.
    failed: (transfer id, reason): the transfer cannot complete (error, lease expired).
    released: D: a cancelled or failed transfer drained (or its lease expired); the
      destination blocks and row may be reused.
    """

    sent: tuple[str, ...] = ()
    landed: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    released: tuple[str, ...] = ()


class KVHandoffPort(Protocol):
    """The KV handoff machinery as an engine sees it (rlt-pd implements it over NIXL).

    P side: `send_chunk` after a chunk's device work completed: write KV positions
      [start, end) of every plane from `source_tables` (P's blocks, one table per plane) to
      `target`; with `final_hidden_row` (P's row holding the last prompt position's state) it is
      the last chunk: the hidden state follows, then the commit. `cancel` stops a transfer.
    D side: `expect` registers a reserved target before P can write; `cancel` asks P to stop and
      drain (the destination stays held until `released`).
    Both: `poll` once per engine step (the engine thread is the only caller); `close` at
      engine shutdown (before the registered memory is dropped).
    """

    def send_chunk(
        self,
        target: HandoffTarget,
        source_tables: tuple[tuple[int, ...], ...],
        start: int,
        end: int,
        final_hidden_row: int | None,
    ) -> None: ...

    def expect(self, target: HandoffTarget, prefill_agent: str) -> None: ...

    def cancel(self, transfer_id: str) -> None: ...

    def poll(self) -> HandoffEvents: ...

    def close(self) -> None: ...
