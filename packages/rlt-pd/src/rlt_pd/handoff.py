"""The KV handoff plan: which bytes P writes into D's KV allocation, in which numbered partitions.

Pure planning (R12): no tensors, no transport. P's worker-side connector turns each partition into
one batch of remote writes plus a sequence-numbered notification; D's scheduler-side connector
tracks the notifications with `ReceiveTracker` (receive.py). See the package README for the whole
handoff sequence and a worked example.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from rlt_contracts import ExecutionIdentity

from rlt_pd.region import KVRegion, KVTensor

DEFAULT_TRANSFER_CHUNK_BYTES = 64 * 1024 * 1024  # PDConfig.transfer_chunk_bytes
DEFAULT_MAX_TRANSFER_DESCRIPTORS = 256  # PDConfig.max_transfer_descriptors

__all__ = [
    "DEFAULT_MAX_TRANSFER_DESCRIPTORS",
    "DEFAULT_TRANSFER_CHUNK_BYTES",
    "HandoffPlan",
    "KVRegion",
    "KVTensor",
    "TransferDescriptor",
    "TransferPartition",
    "plan_handoff",
]


class TransferDescriptor(msgspec.Struct, frozen=True, array_like=True):
    """One contiguous byte range copied from P's `tensor` to D's `tensor`, within one layer.

    Offsets are in bytes from the start of that tensor's storage on each side; `length_bytes` is
    the same on both sides. The range may span several blocks (coalesced) and several planes.
    """

    tensor: KVTensor
    layer: int
    source_offset_bytes: int
    destination_offset_bytes: int
    length_bytes: int


class TransferPartition(msgspec.Struct, frozen=True):
    """One sequence-numbered batch of writes; P posts it as a unit with notification `sequence`.

    kv_bytes: sum of the descriptors' lengths.
    hidden_state_bytes: bytes of the final prompt token's hidden state, written to D's reserved
        hidden-state slot; nonzero only in the last partition. It is one more write, so it counts
        towards both partition limits.
    """

    sequence: int
    descriptors: tuple[TransferDescriptor, ...]
    kv_bytes: int
    hidden_state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.hidden_state_bytes

    @property
    def num_writes(self) -> int:
        """Descriptors plus the hidden-state write, if this partition carries it."""
        return len(self.descriptors) + (1 if self.hidden_state_bytes else 0)


class HandoffPlan(msgspec.Struct, frozen=True):
    """What P sends D for one admission (identity), or for one prefill chunk of it, as partitions
    numbered first_sequence, first_sequence + 1, ...

    Token positions [first_token, valid_tokens) of every plane are sent for every layer, key and
    value. A final plan (the whole admission, or its last chunk) carries the hidden state in its
    last partition; P sends `commit(commit_count)` once every partition is posted; D may activate
    only after all `commit_count` notifications arrived (R18). A non-final chunk plan
    (`final=False`) carries no hidden state and may have no partition at all.
    """

    identity: ExecutionIdentity
    first_token: int
    valid_tokens: int
    num_planes: int
    hidden_state_bytes: int
    partitions: tuple[TransferPartition, ...]
    first_sequence: int = 0
    final: bool = True

    @property
    def commit_count(self) -> int:
        """first_sequence + number of partitions: the commit count when this plan is final
        (the next free sequence number otherwise)."""
        return self.first_sequence + len(self.partitions)

    @property
    def kv_bytes(self) -> int:
        return sum(p.kv_bytes for p in self.partitions)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + (self.hidden_state_bytes if self.final else 0)


def plan_handoff(
    identity: ExecutionIdentity,
    source_tables: Sequence[Sequence[int]],
    destination_tables: Sequence[Sequence[int]],
    valid_tokens: int,
    region: KVRegion,
    *,
    hidden_state_bytes: int,
    destination_region: KVRegion | None = None,
    first_token: int = 0,
    transfer_chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES,
    max_descriptors: int = DEFAULT_MAX_TRANSFER_DESCRIPTORS,
    first_sequence: int = 0,
    final: bool = True,
) -> HandoffPlan:
    """Plan the KV + hidden-state writes of one admission, or of one prefill chunk of it,
    from P's blocks into D's (README.md, "Planning": layout, block tables, valid range,
    descriptor order, partitions, chunks). Raises ValueError on inconsistent input.

    source_tables / destination_tables: one block table per plane, on P / D.
    first_token / valid_tokens: the positions to send, [first_token, valid_tokens) (positions
        before first_token are D's cached prefix).
    region / destination_region: P's / D's KV geometry (default: the same); the per-token
        geometry must match.
    hidden_state_bytes: size of the final prompt token's hidden state (d_model * dtype bytes).
    transfer_chunk_bytes / max_descriptors: per-partition limits on bytes and writes.
    first_sequence: the first partition's number (a chunk continues the previous chunks').
    final: whether this plan ends the admission; only a final plan writes the hidden state.
    """
    dst_region = region if destination_region is None else destination_region
    if not region.same_geometry(dst_region):
        raise ValueError(f"source and destination KV geometry differ: {region} vs {dst_region}")
    if valid_tokens < 0:
        raise ValueError(f"valid_tokens must be >= 0, got {valid_tokens}")
    if not 0 <= first_token <= valid_tokens:
        raise ValueError(f"first_token {first_token} must be in [0, valid_tokens={valid_tokens}]")
    if first_sequence < 0:
        raise ValueError(f"first_sequence must be >= 0, got {first_sequence}")
    if transfer_chunk_bytes < 1 or max_descriptors < 1:
        raise ValueError(
            f"transfer_chunk_bytes ({transfer_chunk_bytes}) and max_descriptors "
            f"({max_descriptors}) must be >= 1"
        )
    if not 1 <= hidden_state_bytes <= transfer_chunk_bytes:
        raise ValueError(
            f"hidden_state_bytes {hidden_state_bytes} must be in [1, transfer_chunk_bytes="
            f"{transfer_chunk_bytes}]: D needs the final prompt token's hidden state for coda"
        )
    pages = _page_ranges(
        source_tables, destination_tables, valid_tokens, first_token, region, dst_region
    )
    descriptors = _descriptors(pages, region, dst_region)
    partitions = _partition(
        descriptors,
        hidden_state_bytes if final else 0,
        transfer_chunk_bytes,
        max_descriptors,
        first_sequence,
    )
    return HandoffPlan(
        identity,
        first_token,
        valid_tokens,
        len(source_tables),
        hidden_state_bytes,
        partitions,
        first_sequence,
        final,
    )


# A page of one plane to send: (source block, destination block, first token, end token), with
# token offsets inside the block ([first, end) positions of that page).
_PageRange = tuple[int, int, int, int]


def _page_ranges(
    source_tables: Sequence[Sequence[int]],
    destination_tables: Sequence[Sequence[int]],
    valid_tokens: int,
    first_token: int,
    region: KVRegion,
    dst_region: KVRegion,
) -> list[list[_PageRange]]:
    """Per plane, the pages holding positions [first_token, valid_tokens), validated."""
    if len(source_tables) == 0:
        raise ValueError("a request has at least one plane; got no source block tables")
    if len(source_tables) != len(destination_tables):
        raise ValueError(
            f"plane count differs: {len(source_tables)} source tables, "
            f"{len(destination_tables)} destination tables"
        )
    block_size = region.block_size
    first_page = first_token // block_size
    end_page = -(-valid_tokens // block_size) if valid_tokens > first_token else first_page
    used_destination: dict[int, tuple[int, int]] = {}
    planes: list[list[_PageRange]] = []
    for plane, (src_table, dst_table) in enumerate(
        zip(source_tables, destination_tables, strict=True)
    ):
        for side, table in (("source", src_table), ("destination", dst_table)):
            if end_page > first_page and len(table) < end_page:
                raise ValueError(
                    f"{side} table of plane {plane} has {len(table)} pages; {end_page} are "
                    f"needed to cover {valid_tokens} tokens at block_size {block_size}"
                )
        ranges: list[_PageRange] = []
        for page in range(first_page, end_page):
            src_block, dst_block = src_table[page], dst_table[page]
            _check_block(src_block, region, "source", plane, page)
            _check_block(dst_block, dst_region, "destination", plane, page)
            if dst_block in used_destination:
                raise ValueError(
                    f"destination block {dst_block} is used by (plane, page) "
                    f"{used_destination[dst_block]} and ({plane}, {page})"
                )
            used_destination[dst_block] = (plane, page)
            start = max(first_token, page * block_size) - page * block_size
            end = min(valid_tokens, (page + 1) * block_size) - page * block_size
            ranges.append((src_block, dst_block, start, end))
        planes.append(ranges)
    return planes


def _check_block(block: int, region: KVRegion, side: str, plane: int, page: int) -> None:
    limit = region.num_blocks
    if block < 0 or (limit is not None and block >= limit):
        valid = "[0, inf)" if limit is None else f"[0, {limit})"
        raise ValueError(f"{side} block id {block} of plane {plane} page {page} is outside {valid}")


def _descriptors(
    planes: list[list[_PageRange]], region: KVRegion, dst_region: KVRegion
) -> list[TransferDescriptor]:
    """One range per (tensor, layer, plane, page); neighbours contiguous on both sides merge.

    Whether two neighbouring ranges are contiguous does not depend on the layer (every offset
    of a layer is its layer-0 offset plus the same layer stride), so the pages are merged into
    runs once per tensor and each run is emitted at every layer: the work grows with the
    descriptors made, not with layers x planes x pages (6144 (page, layer) pairs for a
    512-token prompt of Ouro-1.4B's shape, most of which merge when the block tables are
    contiguous)."""
    token_bytes = region.token_bytes
    ranges = [page for plane in planes for page in plane]
    out: list[TransferDescriptor] = []
    for tensor in KVTensor:
        src_layer, src_block = region.strides_bytes(tensor)
        dst_layer, dst_block = dst_region.strides_bytes(tensor)
        runs: list[list[int]] = []  # [layer-0 source offset, destination offset, length]
        for source, destination, start, end in ranges:
            src = source * src_block + start * token_bytes
            dst = destination * dst_block + start * token_bytes
            length = (end - start) * token_bytes
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1][2] += length
            else:
                runs.append([src, dst, length])
        for layer in range(region.num_layers):
            src_base, dst_base = layer * src_layer, layer * dst_layer
            out.extend(
                TransferDescriptor(tensor, layer, src_base + src, dst_base + dst, length)
                for src, dst, length in runs
            )
    return out


def _split(descriptor: TransferDescriptor, chunk_bytes: int) -> list[TransferDescriptor]:
    """Pieces of at most `chunk_bytes`, in order (only ranges longer than a chunk are split)."""
    pieces = []
    for skip in range(0, descriptor.length_bytes, chunk_bytes):
        length = min(chunk_bytes, descriptor.length_bytes - skip)
        pieces.append(
            TransferDescriptor(
                descriptor.tensor,
                descriptor.layer,
                descriptor.source_offset_bytes + skip,
                descriptor.destination_offset_bytes + skip,
                length,
            )
        )
    return pieces


def _partition(
    descriptors: list[TransferDescriptor],
    hidden_state_bytes: int,
    chunk_bytes: int,
    max_descriptors: int,
    first_sequence: int,
) -> tuple[TransferPartition, ...]:
    """Greedy in-order packing; the hidden state (if any: 0 = a non-final chunk) joins the last
    partition if it fits, else its own. Every partition has total_bytes <= chunk_bytes and
    num_writes <= max_descriptors; a non-final chunk without bytes has no partition."""
    groups: list[list[TransferDescriptor]] = [[]]
    group_bytes = [0]
    for descriptor in descriptors:
        for piece in _split(descriptor, chunk_bytes):
            if (
                group_bytes[-1] + piece.length_bytes > chunk_bytes
                or len(groups[-1]) + 1 > max_descriptors
            ):
                groups.append([])
                group_bytes.append(0)
            groups[-1].append(piece)
            group_bytes[-1] += piece.length_bytes
    if not hidden_state_bytes:
        if not groups[-1]:
            groups.pop()
            group_bytes.pop()
    elif groups[-1] and (
        group_bytes[-1] + hidden_state_bytes > chunk_bytes or len(groups[-1]) + 1 > max_descriptors
    ):
        groups.append([])  # the hidden state travels alone
        group_bytes.append(0)
    last = len(groups) - 1
    return tuple(
        TransferPartition(
            first_sequence + i,
            tuple(group),
            group_bytes[i],
            hidden_state_bytes if i == last else 0,
        )
        for i, group in enumerate(groups)
    )
