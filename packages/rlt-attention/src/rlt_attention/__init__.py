"""Attention backends (paged, depth-aware) with declared capabilities and selection.

Public API:
- `select_attention_backend(requirements, choice="auto") -> BackendSelection`
- backends: `TorchPagedAttention` (cpu/cuda), `TritonPagedAttention` (cuda),
  `FlashAttnBackend` (optional, built from source; constructible only where flash_attn
  imports)
- `known_backends()`, `BACKENDS` (registry), `*_CAPABILITIES` (declared capabilities)

Every backend implements `rlt_contracts.AttentionBackend`: `bind(kv_cache, batch)` returns the
call's `LayerAttention`. Backends hold no state; the KV tensors belong to the runner.
"""

from rlt_attention.flash_attn_backend import FLASH_ATTN_CAPABILITIES, FlashAttnBackend
from rlt_attention.selection import (
    AUTO_PREFERENCE,
    BACKENDS,
    BackendEntry,
    BackendSelection,
    incompatibilities,
    known_backends,
    select_attention_backend,
)
from rlt_attention.torch_backend import TORCH_CAPABILITIES, TorchPagedAttention
from rlt_attention.triton_backend import TRITON_CAPABILITIES, TritonPagedAttention

__all__ = [
    "AUTO_PREFERENCE",
    "BACKENDS",
    "FLASH_ATTN_CAPABILITIES",
    "TORCH_CAPABILITIES",
    "TRITON_CAPABILITIES",
    "BackendEntry",
    "BackendSelection",
    "FlashAttnBackend",
    "TorchPagedAttention",
    "TritonPagedAttention",
    "incompatibilities",
    "known_backends",
    "select_attention_backend",
]
