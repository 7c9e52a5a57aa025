"""Projections whose weight may be fp8: the reference anywhere, measured kernels on CUDA.

`project(linear, x, weight)` is how every projection of the model is called. A plain weight
goes to `linear` (F.linear, the small-batch selector or the batch-invariant GEMM). An
`Fp8Projection` goes to the reference (dequantize, then `linear`: exact on the CPU in fp32)
unless `linear` is the small-batch selector on CUDA, the engine's fast path; then
`Fp8Linear` picks, per (rows bucket, N, K, dtype, device) up to 16 rows, the fastest of

- **weight-only** (rows <= 16): the small-batch Triton kernels streaming the fp8 weight, each
  element widened to the activation dtype in registers, fp32 accumulation, the channel scale
  applied once per output in the epilogue. Half the bytes of bf16 at batch 1, where a loop is
  bound by reading its weights; bf16 activations, so no activation rounding at all. At one row
  also the persistent GEMV of `fp8_gemv` (**weight_only_persistent**: one wave of programs
  walking whole-K tiles with x held in registers, fewer instructions per weight byte).
- **W8A8**: each row of x quantized to e4m3 with its own scale (one Triton kernel,
  scale = max|x_row| / 448), then `torch._scaled_mm` on the fp8 tensor cores with the row
  scales and the channel scales (bf16 out). Twice the bf16 tensor-core rate where a projection
  is compute bound (prefill, large decode batches); the activation rounding costs about 2**-5
  relative per element.
- **dequantize**: the reference (a bf16 copy of the weight per call; always correct).

Beyond 16 rows (prefill chunks, large decode batches) it takes W8A8 where `_scaled_mm` applies
and the reference elsewhere, without measuring: prefill shapes change while the engine serves,
and a measurement synchronizes the device (the dequantizing reference writes a bf16 copy of the
weight and then runs the bf16 GEMM, strictly more work than W8A8's one fp8 read). Up to 16 rows
each candidate is timed as `small_batch_linear` times its own (a CUDA graph of one call per
weight over copies that exceed twice the L2 cache, median of replays) and must compute the
same product first (weight-only within 2% of the output's largest magnitude, as bf16 does;
W8A8 within 10%, the activation rounding). The first call for a shape must not run inside
CUDA-graph capture; the engine's warm-up runs every decode shape eagerly first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from rlt_models import fp8_gemv
from rlt_models import small_batch_linear as sbl
from rlt_models.fp8 import FP8, Fp8Projection, quantize_per_channel

triton, tl = sbl.triton, (sbl.tl if sbl.triton is not None else None)

WEIGHT_ONLY, W8A8, DEQUANTIZE = "weight_only", "w8a8", "dequantize"
WEIGHT_ONLY_PERSISTENT = "weight_only_persistent"  # fp8_gemv.launch_persistent, one row
# Weight-only tiles beside the bf16 ones: an fp8 tile of the same shape has half the bytes in
# flight, so wider K steps (or more rows per CTA) keep as many loads outstanding.
FP8_TILES = (
    sbl.TileConfig(2, 2048, 2, 3, single_row=True),
    sbl.TileConfig(4, 1024, 2, 3, single_row=True),
    sbl.TileConfig(4, 2048, 4, 3, single_row=True),
    sbl.TileConfig(8, 1024, 4, 3, single_row=True),
    # N = 2048 (o, down) gives few CTAs: narrower ones, more of them, deeper pipelines
    sbl.TileConfig(2, 1024, 2, 4, single_row=True),
    sbl.TileConfig(2, 512, 1, 6, single_row=True),
    sbl.TileConfig(4, 512, 2, 6, single_row=True),
    sbl.TileConfig(16, 512, 4, 3),
    sbl.TileConfig(32, 512, 4, 3),
    sbl.TileConfig(16, 128, 2, 8),
)
# output error allowed in the correctness check, relative to the largest output magnitude
TOLERANCE = {WEIGHT_ONLY: 0.02, WEIGHT_ONLY_PERSISTENT: 0.02, W8A8: 0.1, DEQUANTIZE: 0.02}


@dataclass(frozen=True)
class Fp8Choice:
    """How one fp8 shape is computed; `tile` only for WEIGHT_ONLY (a TileConfig) and
    WEIGHT_ONLY_PERSISTENT (a GemvConfig: one restored from the kernel-choice cache, which
    stores every tile as a TileConfig, is mapped back)."""

    kind: str
    tile: sbl.TileConfig | fp8_gemv.GemvConfig | None = None

    def __post_init__(self) -> None:
        if self.kind == WEIGHT_ONLY_PERSISTENT and isinstance(self.tile, sbl.TileConfig):
            object.__setattr__(self, "tile", fp8_gemv.GemvConfig(**asdict(self.tile)))


W8A8_CHOICE, DEQUANTIZE_CHOICE = Fp8Choice(W8A8), Fp8Choice(DEQUANTIZE)


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, k, stride_x, BLOCK_K: tl.constexpr):
        """Row r of x -> e4m3 with scale max|x_r| / 448 (the whole row in registers)."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_K)
        ok = offs < k
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        tl.store(q_ptr + row * k + offs, (x / scale).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA) -> (Q [M, K] e4m3, s [M, 1] fp32) with x ~ s * Q, one kernel."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_rows_kernel[(rows,)](
        x, q, scale, k, x.stride(0), BLOCK_K=block_k, num_warps=8 if block_k >= 4096 else 4
    )
    return q, scale


def w8a8(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (scale * data).T with x quantized per row: `torch._scaled_mm` on fp8 tensor cores."""
    q, row_scale = quantize_rows(x)
    return torch._scaled_mm(
        q, data.t(), scale_a=row_scale, scale_b=scale[None, :], out_dtype=x.dtype
    )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once (W8A8 eligibility is checked per call
    beyond 16 rows)."""
    return torch.cuda.get_device_capability(device)


def run(choice: Fp8Choice, x, data, scale, needed=None) -> torch.Tensor:
    if choice.kind == WEIGHT_ONLY:
        return sbl.launch(x, data, choice.tile, needed, scale=scale)
    if choice.kind == WEIGHT_ONLY_PERSISTENT:
        return fp8_gemv.launch_persistent(x, data, scale, choice.tile, needed)
    if choice.kind == W8A8:
        return w8a8(x, data, scale)
    return F.linear(x, (data.float() * scale[:, None]).to(x.dtype))


class Fp8Linear:
    """Chooses per (rows bucket, N, K, dtype, device) how an fp8 product runs (module doc)."""

    def __init__(self) -> None:
        self.choices: dict[tuple, Fp8Choice] = {}

    def __call__(
        self, x: torch.Tensor, weight: Fp8Projection, needed: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.eligible(x):
            return weight(x, F.linear)
        data, scale = weight.weight, weight.scale
        rows = x.shape[0]
        if rows > sbl.MAX_ROWS:  # no measurement: prefill shapes vary while serving
            choice = W8A8_CHOICE if self.w8a8_eligible(data, x.dtype) else DEQUANTIZE_CHOICE
            return run(choice, x, data, scale)
        key = (sbl._rows_bucket(rows), *data.shape, x.dtype, x.device)
        if key not in self.choices:
            self.choices[key] = self._measure(key[0], data, scale, x.dtype)
        return run(self.choices[key], x, data, scale, needed)

    @staticmethod
    def eligible(x: torch.Tensor) -> bool:
        return (
            triton is not None
            and x.is_cuda
            and not sbl.INTERPRETED
            and x.dim() == 2
            and x.shape[0] > 0
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1
        )

    @staticmethod
    def candidates(rows: int, data: torch.Tensor, dtype: torch.dtype) -> list[Fp8Choice]:
        found = [DEQUANTIZE_CHOICE]
        if rows <= sbl.MAX_ROWS:
            found += [
                Fp8Choice(WEIGHT_ONLY, tile)
                for tile in sbl.CONFIGS + FP8_TILES
                if rows == 1 or not tile.single_row
            ]
        if rows == 1:
            found += [
                Fp8Choice(WEIGHT_ONLY_PERSISTENT, config)
                for config in fp8_gemv.CONFIGS
                if fp8_gemv.eligible(data, config)
            ]
        if Fp8Linear.w8a8_eligible(data, dtype):
            found.append(W8A8_CHOICE)
        return found

    @staticmethod
    def w8a8_eligible(data: torch.Tensor, dtype: torch.dtype) -> bool:
        """`_scaled_mm` with row-wise scales: bf16 out, dims multiples of 16, sm_89+."""
        n, k = data.shape
        return (
            dtype == torch.bfloat16
            and n % 16 == 0
            and k % 16 == 0
            and _capability(data.device) >= (8, 9)
        )

    def _measure(self, rows, data, scale, dtype) -> Fp8Choice:
        """The fastest candidate that computes the product, timed over cold weights."""
        x = torch.randn(rows, data.shape[1], dtype=dtype, device=data.device)
        reference = F.linear(x.float(), data.float() * scale[:, None])
        largest = reference.abs().max().item() + 1e-6
        weights = _cold_copies(data, scale)
        best, best_ms = None, float("inf")
        for choice in self.candidates(rows, data, dtype):
            try:
                out = run(choice, x, data, scale).float()
            except Exception:  # noqa: BLE001 - a layout _scaled_mm refuses, a tile Triton rejects
                continue
            if (out - reference).abs().max().item() > TOLERANCE[choice.kind] * largest:
                continue
            ms = sbl._time_over(weights, _timed(choice, x))
            if ms < best_ms:
                best, best_ms = choice, ms
        return best or DEQUANTIZE_CHOICE


def _timed(choice: Fp8Choice, x: torch.Tensor) -> Callable:
    return lambda weight: run(choice, x, *weight)


def _cold_copies(data: torch.Tensor, scale: torch.Tensor) -> list[tuple]:
    """(data, scale) plus random fp8 copies of its shape, together over twice the L2 cache
    (fewer where memory is short), as `small_batch_linear` times bf16 weights."""
    properties = torch.cuda.get_device_properties(data.device)
    l2_bytes = getattr(properties, "L2_cache_size", 0) or 64 << 20
    wanted = min(sbl.MAX_COPIES, -(-sbl.COLD_L2_FACTOR * l2_bytes // data.numel())) - 1
    free_bytes, _ = torch.cuda.mem_get_info(data.device)
    extra = max(0, min(wanted, free_bytes // 4 // (3 * data.numel())))
    copies = [(data, scale)]
    for _ in range(extra):
        copies.append(quantize_per_channel(torch.randn_like(data, dtype=torch.bfloat16)))
    return copies


fp8_linear = Fp8Linear()


def project(
    linear: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Projection,
    needed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T for a plain weight or an `Fp8Projection` (module doc). `needed` (device
    int32 [1]) is passed to the small-batch selector only, where a Triton choice may skip the
    product and return zeros."""
    if isinstance(weight, Fp8Projection):
        if linear is sbl.small_batch_linear:
            return fp8_linear(x, weight, needed)
        return weight(x, linear)
    if linear is sbl.small_batch_linear:
        return linear(x, weight, needed=needed)
    return linear(x, weight)
