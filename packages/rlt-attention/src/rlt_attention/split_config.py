"""Launch configuration of the split-KV decode kernels (`split_decode_kernel.py`): how many
splits per (group, kv head), the key step, warps, stages and product order, chosen from
bind-time host ints only (a CUDA graph captured with full-width tables keeps a fixed grid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

# Split-KV decode: enough programs to fill about this many SMs twice (H100 / H200 have 132).
DEFAULT_SM_COUNT = 132
MAX_SPLITS = 64
# programs (groups x kv heads) up to which decode uses many short splits (`choose_splits`)
SMALL_GRID = 64
# The products of the split kernel: the tile's (query, head) rows times the keys (the default),
# keys times rows (K q^T and V^T p^T: the widened keys and values of an fp8 cache are then the
# tensor-core product's register operand), or `vector`: one row per tile, multiply-and-sum on
# the CUDA cores (`split_decode_vector.py`; only for one query row per (group, kv head)).
PRODUCTS = ("rows_by_keys", "keys_by_rows", "vector")
# An fp8 cache's large-grid key step (block_n, num_warps, num_stages, product): its keys and
# values are widened in registers, so that per-element work bounds the kernel, not memory (the
# sweeps behind the `vector` step: README.md, "fp8 KV"; docs/results.md). Environment overrides,
# read at import (sweeps): RLT_FP8_SPLIT_DECODE / RLT_SPLIT_DECODE = "block_n,num_warps,
# num_stages[,product 0|1|2]" (an index into PRODUCTS) for the fp8 / model-dtype cache's large
# grid. A vector step applies only where a tile would hold one row; elsewhere that cache keeps
# keys by rows.
FP8_SPLIT_ENV = "RLT_FP8_SPLIT_DECODE"
SPLIT_ENV = "RLT_SPLIT_DECODE"
FP8_LARGE_GRID_STEP = (16, 1, 2, "vector")


def _large_grid_step(variable: str, default: tuple[int, int, int, str] | None):
    given = os.environ.get(variable)
    if not given:
        return default
    fields = [int(v) for v in given.split(",")]
    if len(fields) not in (3, 4) or (len(fields) == 4 and not 0 <= fields[3] < len(PRODUCTS)):
        raise ValueError(f"{variable}={given!r}: expected block_n,num_warps,num_stages[,0|1|2]")
    block_n, num_warps, num_stages = fields[:3]
    return block_n, num_warps, num_stages, PRODUCTS[fields[3] if len(fields) == 4 else 0]


_fp8_step = _large_grid_step(FP8_SPLIT_ENV, FP8_LARGE_GRID_STEP)
_model_dtype_step = _large_grid_step(SPLIT_ENV, None)  # None: the heuristic below


@dataclass(frozen=True)
class SplitConfig:
    """Launch configuration of the split-KV decode kernels (host ints)."""

    num_splits: int
    block_m: int  # rows of the tl.dot tile: the q x G (query, head) pairs padded to >= 16
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int = 3  # software-pipelining depth of the key loop (Triton's default)
    product: str = "rows_by_keys"  # one of PRODUCTS

    def __post_init__(self) -> None:
        if self.product not in PRODUCTS:
            raise ValueError(f"product must be one of {PRODUCTS}, got {self.product!r}")


def choose_splits(
    *,
    num_groups: int,
    num_kv_heads: int,
    max_context_len: int,
    queries_per_kv: int,
    head_dim: int,
    sm_count: int = DEFAULT_SM_COUNT,
    num_splits: int | None = None,
    block_n: int | None = None,
    queries_per_group: int = 1,
    kv_fp8: bool = False,
    stores_in_kernel: bool = False,
) -> SplitConfig:
    """Splits per (group, kv head) and the key step, from bind-time host ints only (a graph
    captured with full-width tables keeps a fixed grid). `num_splits` / `block_n` override the
    heuristic (tests; `block_n` a power of two >= 16).

    Heuristic (head_dim <= 128; README.md, "Backends and capabilities", gives the rule and the
    sweeps behind it): up to SMALL_GRID programs (groups x kv heads) many short splits, else
    ceil(2 * sm_count / programs) splits of 64-key steps; capped at MAX_SPLITS and at one key
    step each. `queries_per_group`: the call's max_query_len (a group's q queries x G heads are
    the tile's rows). `kv_fp8`: the large grid takes FP8_LARGE_GRID_STEP's key step, warps,
    stages and product instead (the model-dtype cache takes RLT_SPLIT_DECODE's when it is set);
    a `vector` product needs one row per tile and no in-kernel store or merge
    (`stores_in_kernel`), else keys by rows."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    programs = max(1, num_groups * num_kv_heads)
    small_grid = programs <= SMALL_GRID and block_d <= 128
    num_stages = 3
    step = _fp8_step if kv_fp8 else _model_dtype_step
    tuned_step = step is not None and not small_grid and block_n is None and block_d <= 128
    product = "rows_by_keys"
    if tuned_step:
        block_n, tuned_warps, num_stages, product = step
        one_row = queries_per_group * queries_per_kv == 1
        if product == "vector" and (stores_in_kernel or not one_row):
            product = "keys_by_rows"
    if block_n is None:
        if small_grid:
            block_n = 16 if programs <= SMALL_GRID // 2 else 32
        else:
            block_n = 64 if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        per_sm = 6 if small_grid else 2
        num_splits = -(-per_sm * sm_count // programs)
        num_splits = min(num_splits, MAX_SPLITS, max(1, -(-max_context_len // block_n)))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # A 16-row tl.dot tile also for G == 1: on an H200 it beat vector reductions over the keys
    # (10 vs 12 us per layer at batch 1, 71 vs 120 us at batch 32; Ouro-1.4B, context 1088).
    block_m = max(16, triton.next_power_of_2(queries_per_group * queries_per_kv))
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    if small_grid:
        num_warps, num_stages = (2 if block_n == 16 else 4), 2
    if tuned_step:
        num_warps = tuned_warps
    return SplitConfig(num_splits, block_m, block_n, block_d, num_warps, num_stages, product)
