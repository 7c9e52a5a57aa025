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
    """What a backend supports. Empty `block_size_multiple_of` constraints are written as 1.

    supports_cuda_graphs: a decode call can be captured in a CUDA graph and replayed after the
      runner rewrites the batch metadata in place (fixed launch shapes, no host allocation that
      depends on the call's values). Declared per backend, never inferred from a version (R13).
    supports_batch_invariance: the backend can be built in a batch-invariant mode, in which a
      query row's output depends only on its own query, its own context's keys/values and the
      head layout, never on the other groups or rows of the call, the call's max_query_len /
      max_context_len, or where the row sits in the batch (bitwise; docs/serving.md says where
      this is tested and where it is only argued).
    """

    name: str
    device_types: tuple[str, ...]  # torch device types, e.g. ("cpu", "cuda")
    dtypes: tuple[str, ...]  # torch dtype names, e.g. ("float32", "bfloat16")
    max_head_dim: int
    block_size_multiple_of: int = 1
    # layouts the backend reads correctly: each is plain paged KV, one block table per plane
    kv_layouts: tuple[KVLayout, ...] = (KVLayout.LAST_EXITED, KVLayout.SHARED, KVLayout.RING)
    supports_multi_token_queries: bool = True  # prefill chunks (several queries per sequence)
    supports_cuda_graphs: bool = False
    supports_batch_invariance: bool = False
    supports_fp8_kv: bool = False  # reads and writes a float8_e4m3fn cache with per-layer scales
    # (0.3.0) a call's groups may be bidirectional (`PagedAttentionBatch.causal` False): every
    # query sees its group's whole context (a prefix-LM family's prompt)
    supports_bidirectional_prompt: bool = False
    # (0.3.1) a layer may pass `window` (LayerAttention): keys before p - W + 1 are not seen
    supports_sliding_window: bool = False


class AttentionRequirements(msgspec.Struct, frozen=True):
    """What one engine configuration needs from its attention backend.

    cuda_graphs: the engine will capture its decode ticks as CUDA graphs (requested and on a
      CUDA device). A preference, not a hard requirement: a backend that cannot be captured
      still serves, but decode then runs eagerly, so selection prefers a capturable backend and
      reports loudly when the one it returns cannot be captured (rlt-attention's selection).
    batch_invariant: the engine runs in batch-invariant mode (EngineConfig.batch_invariant): a
      hard requirement, met only by a backend declaring `supports_batch_invariance`, which is
      then built in that mode.
    """

    device_type: str
    dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    kv_layout: KVLayout
    cuda_graphs: bool = False
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8"
    bidirectional_prompt: bool = False  # (0.3.0) the family's prompts are prefix-LM blocks
    sliding_window: bool = False  # (0.3.1) some layer of the family attends within a window


class UnmetRequirement(msgspec.Struct, frozen=True):
    """One reason a backend cannot serve a configuration.

    option: the engine option (EngineConfig field) to change: "device", "dtype", "block_size",
      "kv_layout", "attention_backend" (the backend cannot run in this process at all), or
      "model" (head dim / head counts come from the checkpoint).
    reason: plain words, including what would work (e.g. the block sizes a backend needs).
    """

    option: str
    reason: str

    def __str__(self) -> str:
        return self.reason


def unmet_requirements(
    caps: AttentionCapabilities, req: AttentionRequirements
) -> list[UnmetRequirement]:
    """Every hard reason `caps` cannot serve `req` (empty list: compatible). CUDA-graph capture
    is not among them: it changes how fast decode runs, not whether the backend serves."""
    unmet = []
    if req.device_type not in caps.device_types:
        unmet.append(
            UnmetRequirement(
                "device", f"device {req.device_type!r} not in {list(caps.device_types)}"
            )
        )
    if req.dtype not in caps.dtypes:
        unmet.append(UnmetRequirement("dtype", f"dtype {req.dtype} not in {list(caps.dtypes)}"))
    if req.head_dim > caps.max_head_dim:
        unmet.append(UnmetRequirement("model", f"head_dim {req.head_dim} > {caps.max_head_dim}"))
    if req.block_size % caps.block_size_multiple_of:
        multiple = caps.block_size_multiple_of
        unmet.append(
            UnmetRequirement(
                "block_size",
                f"block_size {req.block_size} is not a multiple of {multiple}: {caps.name} needs "
                f"block_size {multiple}, {2 * multiple}, ... (e.g. block_size={multiple})",
            )
        )
    if req.kv_layout not in caps.kv_layouts:
        unmet.append(UnmetRequirement("kv_layout", f"kv layout {req.kv_layout.value} unsupported"))
    if req.batch_invariant and not caps.supports_batch_invariance:
        unmet.append(
            UnmetRequirement(
                "batch_invariant",
                f"{caps.name} has no batch-invariant mode (batch_invariant=False allows it)",
            )
        )
    if req.bidirectional_prompt and not caps.supports_bidirectional_prompt:
        unmet.append(
            UnmetRequirement(
                "model",
                f"{caps.name} cannot attend bidirectionally over a prompt, which this model's "
                "family needs (a prefix-LM prompt)",
            )
        )
    if req.kv_cache_dtype == "fp8" and not caps.supports_fp8_kv:
        unmet.append(
            UnmetRequirement(
                "kv_cache_dtype",
                f"{caps.name} cannot read an fp8 KV cache (kv_cache_dtype='auto' allows it)",
            )
        )
    if req.num_heads % req.num_kv_heads:
        unmet.append(
            UnmetRequirement(
                "model", f"{req.num_heads} heads not a multiple of {req.num_kv_heads} kv heads"
            )
        )
    return unmet


@dataclass(frozen=True)
class KVCacheTensors:
    """Device KV storage owned by the runner: key/value [L, num_blocks, block_size, Hkv, D].

    A slot is `block_id * block_size + offset`; one block holds `block_size` positions of one
    plane for every layer.

    key_scale / value_scale: None, or fp32 [L] on the cache's device when the cache is
    float8_e4m3fn: layer l stores x as round(x / scale[l]) and reads it back as stored * scale[l]
    (one scale per layer, shared by every loop plane, so planes can be copied as raw bytes).
    """

    key_cache: Tensor
    value_cache: Tensor
    key_scale: Tensor | None = None
    value_scale: Tensor | None = None

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
    causal (0.3.0): True, each query sees keys up to its own position; False, every query of
      a group sees the group's whole context (a prefix-LM prompt prefilled in one pass; only
      for backends declaring `supports_bidirectional_prompt`).

    Rows past query_start[S] belong to no group (the padding of a captured prefill graph): their
    key/value is still stored at their write slot (the runner points those at the scratch slot)
    and their output is unspecified.
    """

    query_start: Tensor
    context_lengths: Tensor
    block_tables: Tensor
    write_slots: Tensor
    max_query_len: int
    max_context_len: int
    causal: bool = True


class AttentionBackend(Protocol):
    """A paged attention implementation. `bind` returns the per-call `LayerAttention`."""

    capabilities: AttentionCapabilities

    def bind(self, kv_cache: KVCacheTensors, batch: PagedAttentionBatch) -> LayerAttention: ...
