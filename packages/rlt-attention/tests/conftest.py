"""Fixtures of the rlt-attention tests: small paged layouts and a naive fp64 reference.

Without CUDA the Triton kernel runs in Triton's interpreter, which must be switched on before
the kernel is decorated, i.e. before `rlt_attention` is first imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
from rlt_contracts import KVCacheTensors, PagedAttentionBatch  # noqa: E402


@dataclass
class PagedCase:
    """One model call over `groups` [(q_len, context_len)] at layer `layer_index`.

    The cache is NaN except the history (positions < context_len - q_len) of every group, which
    holds random values in every layer; the call's own positions are NaN until written.
    `block_rows` is each group's block table (host lists); unused table entries are -1.
    """

    groups: list[tuple[int, int]]
    block_size: int
    layer_index: int
    block_rows: list[list[int]]
    kv_cache: KVCacheTensors
    batch: PagedAttentionBatch
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache_before: torch.Tensor
    value_cache_before: torch.Tensor

    def slot(self, group: int, position: int) -> int:
        block = self.block_rows[group][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def run(self, backend) -> torch.Tensor:
        """One layer call of `backend` on this case (bind, then call at `layer_index`)."""
        return backend.bind(self.kv_cache, self.batch)(
            self.layer_index, self.query, self.key, self.value
        )

    def assert_calls_do_not_sync(self, backend) -> None:
        """CUDA: after a warm-up call, `bind` and a call per layer make no host-device sync
        (torch.cuda.set_sync_debug_mode("error"), which does not catch every sync)."""
        self.run(backend)  # compile / warm up outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            attention = backend.bind(self.kv_cache, self.batch)
            for layer in range(self.kv_cache.key_cache.shape[0]):
                attention(layer, self.query, self.key, self.value)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def make_case(
    groups,
    *,
    block_size,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_layers=3,
    layer_index=1,
    dtype=torch.float32,
    seed=0,
    spare_blocks=3,
    num_blocks=None,
    max_pages=None,
    device="cpu",
) -> PagedCase:
    """Random paged layout; `num_blocks` / `max_pages` fix the cache and table shapes."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(ctx / block_size) for _, ctx in groups]
    num_blocks = num_blocks or sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # fragmented, non-monotonic
    block_rows, taken = [], 0
    for count in pages:
        block_rows.append(order[taken : taken + count])
        taken += count
    # At least one padding column (-1) beyond every context.
    max_pages = max_pages or max(pages, default=0) + 1
    tables = torch.full((len(groups), max_pages), -1, dtype=torch.int32)
    for g, row in enumerate(block_rows):
        tables[g, : len(row)] = torch.tensor(row, dtype=torch.int32)

    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    key_flat = key_cache.view(num_layers, -1, num_kv_heads, head_dim)
    value_flat = value_cache.view(num_layers, -1, num_kv_heads, head_dim)
    case = PagedCase(
        groups, block_size, layer_index, block_rows, None, None, None, None, None, None, None
    )
    write_slots, query_start = [], [0]
    for g, (q_len, ctx) in enumerate(groups):
        for p in range(ctx):
            if p < ctx - q_len:
                history = torch.randn((num_layers, num_kv_heads, head_dim), generator=gen)
                key_flat[:, case.slot(g, p)] = history.to(dtype)
                value_flat[:, case.slot(g, p)] = torch.randn(history.shape, generator=gen).to(dtype)
            else:
                write_slots.append(case.slot(g, p))
        query_start.append(query_start[-1] + q_len)
    num_rows = query_start[-1]

    def randn(*size):
        return torch.randn(size, generator=gen).to(dtype).to(device)

    case.query = randn(num_rows, num_heads, head_dim)
    case.key = randn(num_rows, num_kv_heads, head_dim)
    case.value = randn(num_rows, num_kv_heads, head_dim)
    case.kv_cache = KVCacheTensors(key_cache.to(device), value_cache.to(device))
    case.key_cache_before = key_cache.clone()
    case.value_cache_before = value_cache.clone()
    case.batch = PagedAttentionBatch(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_lengths=torch.tensor([ctx for _, ctx in groups], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
        max_query_len=max((q for q, _ in groups), default=0),
        max_context_len=max((c for _, c in groups), default=0),
    )
    return case


def naive_reference(
    case: PagedCase, layer_index: int | None = None, key=None, value=None, *, causal=True
):
    """fp64 attention by explicit loops over positions, after writing the call's k/v
    (`causal` False: every query sees its group's whole context).

    Returns [N, H, D] float64. Keys/values are first rounded to the cache dtype, as the contract
    stores them; the query is used as given.
    """
    layer = case.layer_index if layer_index is None else layer_index
    key = case.key if key is None else key
    value = case.value if value is None else value
    cache_dtype = case.key_cache_before.dtype
    _, _, _, kv_heads, head_dim = case.key_cache_before.shape
    keys = case.key_cache_before[layer].reshape(-1, kv_heads, head_dim).double().clone()
    values = case.value_cache_before[layer].reshape(-1, kv_heads, head_dim).double().clone()
    query = case.query.double().cpu()
    for n, slot in enumerate(case.batch.write_slots.tolist()):
        keys[slot] = key[n].to(cache_dtype).double().cpu()
        values[slot] = value[n].to(cache_dtype).double().cpu()
    num_rows, num_heads, _ = query.shape
    per_kv = num_heads // kv_heads
    out = torch.zeros((num_rows, num_heads, head_dim), dtype=torch.float64)
    row = 0
    for g, (q_len, ctx) in enumerate(case.groups):
        for i in range(q_len):
            position = ctx - q_len + i
            seen = position + 1 if causal else ctx  # causal: keys 0..position
            slots = [case.slot(g, p) for p in range(seen)]
            for h in range(num_heads):
                k = keys[slots, h // per_kv]  # [position + 1, D]
                v = values[slots, h // per_kv]
                weights = torch.softmax(k @ query[row, h] * head_dim**-0.5, dim=0)
                out[row, h] = weights @ v
            row += 1
    return out


@pytest.fixture
def paged_case():
    return make_case


@pytest.fixture
def reference():
    return naive_reference
