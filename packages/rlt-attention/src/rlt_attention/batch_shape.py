"""Host-only validation of a `PagedAttentionBatch` against the KV cache and of one layer call
(its inputs' shapes and its sliding window).

Only shapes, dtypes and devices are checked: reading tensor values would force a device sync,
which the per-call path must not do (R21). Value-level preconditions (query_start ascending,
q_len <= context_length, block ids in range, distinct write slots) are the runner's contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlt_contracts import PagedAttentionBatch

from rlt_attention.kv_store import SlotViews


@dataclass(frozen=True)
class BatchShape:
    """Host ints of one model call: S groups, N query rows, pages read per group."""

    num_groups: int
    num_rows: int
    block_size: int
    max_query_len: int
    max_context_len: int
    pages_read: int  # ceil(max_context_len / block_size): block-table columns that are read


def check_batch(views: SlotViews, block_size: int, batch: PagedAttentionBatch) -> BatchShape:
    """Return the call's host sizes; raise ValueError on inconsistent shapes or devices."""
    num_groups = int(batch.context_lengths.shape[0])
    num_rows = int(batch.write_slots.shape[0])
    if tuple(batch.query_start.shape) != (num_groups + 1,):
        raise ValueError(
            f"query_start must be [{num_groups + 1}], got {tuple(batch.query_start.shape)}"
        )
    if batch.block_tables.dim() != 2 or batch.block_tables.shape[0] != num_groups:
        raise ValueError(
            f"block_tables must be [{num_groups}, max_pages], got {tuple(batch.block_tables.shape)}"
        )
    if batch.write_slots.dtype != torch.int64:
        raise ValueError(f"write_slots must be int64, got {batch.write_slots.dtype}")
    pages_read = -(-batch.max_context_len // block_size)
    if batch.block_tables.shape[1] < pages_read:
        raise ValueError(
            f"block_tables has {batch.block_tables.shape[1]} pages per group; "
            f"max_context_len {batch.max_context_len} needs {pages_read} at block_size {block_size}"
        )
    device = views.key_slots.device
    for name in ("query_start", "context_lengths", "block_tables", "write_slots"):
        if getattr(batch, name).device != device:
            raise ValueError(f"{name} is on {getattr(batch, name).device}, KV cache on {device}")
    return BatchShape(
        num_groups, num_rows, block_size, batch.max_query_len, batch.max_context_len, pages_read
    )


def check_layer_inputs(views: SlotViews, num_rows: int, query, key, value) -> None:
    """Host-only shape checks of one layer call: query [N, H, D], key/value [N, Hkv, D]."""
    _, _, kv_heads, head_dim = views.key_slots.shape
    if query.dim() != 3 or query.shape[0] != num_rows or query.shape[2] != head_dim:
        raise ValueError(f"query must be [{num_rows}, H, {head_dim}], got {tuple(query.shape)}")
    expected_kv = (num_rows, kv_heads, head_dim)
    if tuple(key.shape) != expected_kv or tuple(value.shape) != expected_kv:
        raise ValueError(
            f"key/value must be {list(expected_kv)}, got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] % kv_heads:
        raise ValueError(f"{query.shape[1]} query heads not a multiple of {kv_heads} kv heads")


def check_window(
    window: int | None, batch: PagedAttentionBatch, max_context_len: int
) -> int | None:
    """A layer call's sliding window W (README.md, "Sliding window"), or None for the whole
    context: `window` None, or a W of at least `max_context_len`, which hides no key (the call
    takes the unwindowed path). Host ints only (no sync). ValueError for a window that is not
    an int >= 1 or one over bidirectional groups (`batch.causal` False)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window must be None or an int >= 1 (a query at position p sees keys p - window + 1 "
            f".. p), got {window!r}"
        )
    if not batch.causal:
        raise ValueError(
            f"window {window} given for bidirectional groups (causal=False): a sliding window "
            "applies to causal groups only (a prefix-LM prompt sees its whole context)"
        )
    return None if window >= max_context_len else window
