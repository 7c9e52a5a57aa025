"""`SamplingBatch`: the per-row sampling settings of one step, as device tensors plus host flags.

Rows arrive as `rlt_contracts.SamplingRow(params, output_index)`: the request's parameters with
its seed already resolved, and the output index of the token being sampled (0 = the token
produced by prefill), which is the row's position ("counter") in the request's random stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rlt_contracts import SamplingRow

# Temperatures in (0, MIN_TEMPERATURE) are raised to it so logits / temperature stays finite in
# fp32 (|logit| up to ~1e30 would be needed to overflow). At such temperatures the distribution
# is already a point mass on the argmax except between logits closer than ~1e-5.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Sampling settings of N logits rows; row n of every tensor describes logits row n.

    Device tensors (all on one device, shape [N]; borrowed read-only by `Sampler.sample`):
      temperature: fp32; exactly 0 means greedy, otherwise >= MIN_TEMPERATURE.
      top_k: int64; <= 0 or >= vocab size means disabled.
      top_p: fp32 in (0, 1]; 1 means disabled.
      seed: int64 in [0, 2**63); the request's stream seed.
      counter: int64 >= 0; the row's output_index (its position in the request's stream).

    Host values (computed once by `build`, read without any device sync):
      all_greedy: every row is greedy (also True for N = 0): no noise, no filtering.
      any_top_k_top_p: some non-greedy row asked for top-k or top-p: the sort is needed.
      num_top_logprobs: largest `logprobs` asked in the batch; None when no row asked;
        0 when rows only want the chosen token's logprob.
      requested_logprobs: per row, its `params.logprobs` (None = that row wants none).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    all_greedy: bool
    any_top_k_top_p: bool
    num_top_logprobs: int | None
    requested_logprobs: tuple[int | None, ...]

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str) -> SamplingBatch:
        """Batch of `rows` on `device`: host lists, then one host-to-device copy per tensor.

        Raises ValueError for a row whose seed is unresolved (None) or whose output_index is not
        an int in [0, 2**63).
        """
        for row in rows:
            _check_row(row)
        params = [row.params for row in rows]
        random_params = [p for p in params if not p.greedy]
        requested = tuple(p.logprobs for p in params)
        wanted = [n for n in requested if n is not None]
        return cls(
            temperature=torch.tensor(
                [0.0 if p.greedy else max(p.temperature, MIN_TEMPERATURE) for p in params],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seed=torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
            counter=torch.tensor(
                [row.output_index for row in rows], dtype=torch.int64, device=device
            ),
            all_greedy=not random_params,
            any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in random_params),
            num_top_logprobs=max(wanted) if wanted else None,
            requested_logprobs=requested,
        )


def _check_row(row: SamplingRow) -> None:
    if row.params.seed is None:
        raise ValueError("a SamplingRow needs a resolved seed (params.seed is None)")
    index = row.output_index
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**63:
        raise ValueError(f"output_index must be an int in [0, 2**63), got {index!r}")
