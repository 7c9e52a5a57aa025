"""`SamplerOutput`: one step's sampled tokens on the device, and their single read-back to host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class HostSample(NamedTuple):
    """One row's result as Python values.

    logprob: the chosen token's log-probability under the RAW logits (see `Sampler`), or None
      when the row asked for no logprobs.
    top_logprobs: the row's requested number of (token_id, logprob) pairs, most likely first
      (empty when it asked for none or for 0).
    """

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Device results of `Sampler.sample` for N rows (all tensors on the logits' device).

    token_ids: int64 [N], the sampled tokens (may feed the next step without leaving the device).
    logprobs: fp32 [N] log-probability of token_ids, or None when no row asked for logprobs.
    top_token_ids: int64 [N, k] and top_logprobs: fp32 [N, k], the k = min(num_top_logprobs, V)
      most likely tokens of each row, most likely first (k may be 0); None when logprobs is None.
    requested_logprobs: host, per row, its own `logprobs` request (None = none), used to trim
      the batch-wide k to each row's request in `to_host`.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    requested_logprobs: tuple[int | None, ...]

    def to_host(self) -> list[HostSample]:
        """Per-row Python results with ONE device-to-host transfer (blocks until the step's
        sampling has finished on the device).

        All fields are packed into one fp64 [N, 2 + 2k] tensor before the copy: token ids
        (< 2**53) and fp32 logprobs are both exact in fp64, so nothing is rounded.
        """
        columns = [self.token_ids[:, None]]
        if self.logprobs is not None:
            assert self.top_token_ids is not None and self.top_logprobs is not None
            columns += [self.logprobs[:, None], self.top_token_ids, self.top_logprobs]
        packed = torch.cat([column.to(torch.float64) for column in columns], dim=1).tolist()
        return [
            _unpack_row(values, requested)
            for values, requested in zip(packed, self.requested_logprobs, strict=True)
        ]


def _unpack_row(values: list[float], requested: int | None) -> HostSample:
    token_id = int(values[0])
    if requested is None:
        return HostSample(token_id, None, ())
    num_alternatives = (len(values) - 2) // 2  # batch-wide k, already capped at the vocab size
    kept = min(requested, num_alternatives)
    alternative_ids = values[2 : 2 + kept]
    alternative_logprobs = values[2 + num_alternatives : 2 + num_alternatives + kept]
    top = tuple(
        (int(token), logprob)
        for token, logprob in zip(alternative_ids, alternative_logprobs, strict=True)
    )
    return HostSample(token_id, values[1], top)
