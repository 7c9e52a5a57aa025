"""Attention-backend contracts: declared capabilities, requirements, and paged batch metadata.

Backends (rlt-attention) declare what they support; the engine selects one against the actual
requirements (device, dtype, head dim, block size, layout) and reports why (R13, R14). The
runner (rlt-runner) owns the KV tensors and builds `PagedAttentionBatch` for every model call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rlt_contracts.kv import KVLayout
from rlt_contracts.model import LayerAttention

Tensor = Any


class AttentionCapabilities(msgspec.Struct, frozen=True):
    """What a backend supports. Empty `block_size_multiple_of` constraints are written as 1."""

    name: str
    device_types: tuple[str, ...]  # torch device types, e.g. ("cpu", "cuda")
    dtypes: tuple[str, ...]  # torch dtype names, e.g. ("float32", "bfloat16")
    max_head_dim: int
    block_size_multiple_of: int = 1
    kv_layouts: tuple[KVLayout, ...] = (KVLayout.LAST_EXITED, KVLayout.SHARED)
    supports_multi_token_queries: bool = True  # prefill chunks (several queries per sequence)
    supports_cuda_graphs: bool = False


class AttentionRequirements(msgspec.Struct, frozen=True):
    """What one engine configuration needs from its attention backend."""

    device_type: str
    dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    kv_layout: KVLayout
    cuda_graphs: bool = False


def unmet_requirements(caps: AttentionCapabilities, req: AttentionRequirements) -> list[str]:
    """Every reason `caps` cannot serve `req`, in plain words (empty list: compatible)."""
    reasons = []
    if req.device_type not in caps.device_types:
        reasons.append(f"device {req.device_type!r} not in {list(caps.device_types)}")
    if req.dtype not in caps.dtypes:
        reasons.append(f"dtype {req.dtype} not in {list(caps.dtypes)}")
    if req.head_dim > caps.max_head_dim:
        reasons.append(f"head_dim {req.head_dim} > {caps.max_head_dim}")
    if req.block_size % caps.block_size_multiple_of:
        reasons.append(
            f"block_size {req.block_size} not a multiple of {caps.block_size_multiple_of}"
        )
    if req.kv_layout not in caps.kv_layouts:
        reasons.append(f"kv layout {req.kv_layout.value} unsupported")
    if req.num_heads % req.num_kv_heads:
        reasons.append(f"{req.num_heads} heads not a multiple of {req.num_kv_heads} kv heads")
    if req.cuda_graphs and not caps.supports_cuda_graphs:
        reasons.append("CUDA graphs unsupported")
    return reasons


@dataclass(frozen=True)
class KVCacheTensors:
    """Device KV storage owned by the runner: key/value [L, num_blocks, block_size, Hkv, D].

    A slot is `block_id * block_size + offset`; one block holds `block_size` positions of one
    plane for every layer.
    """

    key_cache: Tensor
    value_cache: Tensor

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[2])


@dataclass(frozen=True)
class PagedAttentionBatch:
    """Metadata of one model call over S sequence groups and N query tokens (device tensors).

    A group is a run of consecutive positions of one request read at one plane (one decode row,
    or one prefill chunk at one loop). Its queries are the last `q_len` positions of its context.

    query_start: [S + 1] int32, group g owns query rows [query_start[g], query_start[g+1]).
    context_lengths: [S] int32, keys visible to the group's last query (its own tokens included).
    block_tables: [S, max_pages] int32, physical block of each logical page of the group's plane.
    write_slots: [N] int64, slot where each query token's key/value is stored before reading.
    max_query_len / max_context_len: host ints (kernel launch sizes, no device sync needed).
    """

    query_start: Tensor
    context_lengths: Tensor
    block_tables: Tensor
    write_slots: Tensor
    max_query_len: int
    max_context_len: int


class AttentionBackend(Protocol):
    """A paged attention implementation. `bind` returns the per-call `LayerAttention`."""

    capabilities: AttentionCapabilities

    def bind(self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch) -> LayerAttention: ...
