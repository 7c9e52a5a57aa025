"""`SamplingBatch`: the per-row sampling settings of one step, as device tensors plus host flags.

Rows arrive as `rlt_contracts.SamplingRow(params, output_index)`: the request's parameters with
its seed already resolved, and the output index of the token being sampled (0 = the token
produced by prefill), which is the row's position ("counter") in the request's random stream.
Rows whose parameters adjust logits (penalties, logit_bias, min_tokens) also carry their token
history (prompt, outputs so far, stop ids), from which `build` makes the same device state the
runner keeps in its rows (`rlt_contracts.LogitsAdjustments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rlt_contracts import LogitsAdjustments, SamplingMode, SamplingRow
from rlt_contracts.sampling import MAX_LOGIT_BIAS

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

    Optional steps (None / False: no row uses them, no kernel runs):
      min_p: fp32 [N] when some random row has min_p > 0.
      adjustments: the device state of the steps before temperature, when some row uses
        penalties, logit_bias or min_tokens; `penalized`, `biased`, `min_tokens` say which
        groups of it are filled (see `rlt_contracts.LogitsAdjustments`).
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
    min_p: torch.Tensor | None = None
    adjustments: LogitsAdjustments | None = None
    penalized: bool = False
    biased: bool = False
    min_tokens: bool = False
    constrained: bool = False

    @property
    def adjustment_mode(self) -> SamplingMode:
        """The flags of the steps before temperature (what `adjust_logits` runs)."""
        return SamplingMode(
            penalized=self.penalized,
            biased=self.biased,
            min_tokens=self.min_tokens,
            constrained=self.constrained,
        )

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @classmethod
    def of_rows(
        cls,
        *,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seed: torch.Tensor,
        counter: torch.Tensor,
        mode: SamplingMode,
        min_p: torch.Tensor | None = None,
        adjustments: LogitsAdjustments | None = None,
    ) -> SamplingBatch:
        """A batch over per-row device tensors (the `TokenSampler` keywords), the work fixed
        by `mode`: no host value is read from a tensor, so it can be built inside a CUDA graph
        capture. Raises ValueError when the mode needs a tensor that is missing."""
        if mode.min_p and min_p is None:
            raise ValueError("mode.min_p needs the rows' min_p")
        if mode.adjusts_logits and adjustments is None:
            raise ValueError(f"{mode} needs the rows' logits adjustments")
        return cls(
            temperature=torch.where(temperature > 0, temperature.clamp(min=MIN_TEMPERATURE), 0.0),
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            counter=counter,
            all_greedy=not mode.random,
            any_top_k_top_p=mode.filtered,
            num_top_logprobs=mode.top_logprobs,
            requested_logprobs=(mode.top_logprobs,) * int(temperature.shape[0]),
            min_p=min_p if mode.min_p and mode.random else None,
            adjustments=adjustments if mode.adjusts_logits else None,
            penalized=mode.penalized,
            biased=mode.biased,
            min_tokens=mode.min_tokens,
            constrained=mode.constrained,
        )

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        device: torch.device | str,
        *,
        vocab_size: int | None = None,
    ) -> SamplingBatch:
        """Batch of `rows` on `device`: host lists, then one host-to-device copy per tensor.

        vocab_size: V, needed when some row adjusts logits (the [N, V] state is built here).
        Raises ValueError for a row whose seed is unresolved (None), whose output_index is not
        an int in [0, 2**63), whose penalties come without exactly `output_index` output ids,
        or whose token ids are outside [0, vocab_size).
        """
        for row in rows:
            _check_row(row)
        params = [row.params for row in rows]
        random_params = [p for p in params if not p.greedy]
        requested = tuple(p.logprobs for p in params)
        wanted = [n for n in requested if n is not None]
        any_min_p = any(p.min_p > 0 for p in random_params)
        penalized = any(p.penalized for p in params)
        biased = any(p.logit_bias for p in params)
        min_tokens = any(p.min_tokens > 0 for p in params)
        adjustments = None
        if penalized or biased or min_tokens:
            if vocab_size is None:
                raise ValueError("rows that adjust logits need the vocabulary size")
            adjustments = _build_adjustments(
                rows,
                device,
                vocab_size,
                penalized=penalized,
                biased=biased,
                min_tokens=min_tokens,
            )
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
            min_p=(
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
                if any_min_p
                else None
            ),
            adjustments=adjustments,
            penalized=penalized,
            biased=biased,
            min_tokens=min_tokens,
        )


def _build_adjustments(
    rows: Sequence[SamplingRow],
    device: torch.device | str,
    vocab_size: int,
    *,
    penalized: bool,
    biased: bool,
    min_tokens: bool,
) -> LogitsAdjustments:
    """The [N, V] / [N, K] state of the adjustment steps some row uses (the others None)."""
    num_rows = len(rows)
    fields = {}
    if penalized:
        prompt_pairs = [(n, t) for n, row in enumerate(rows) for t in row.prompt_token_ids]
        output_pairs = [(n, t) for n, row in enumerate(rows) for t in row.output_token_ids]
        for row in rows:
            if row.params.penalized and len(row.output_token_ids) != row.output_index:
                raise ValueError(
                    f"a penalized row needs its {row.output_index} output ids, got "
                    f"{len(row.output_token_ids)}"
                )
        _check_ids([t for _, t in prompt_pairs + output_pairs], vocab_size)
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        if output_pairs:
            index = torch.tensor(output_pairs, dtype=torch.int64, device=device).T
            counts.index_put_(
                (index[0], index[1]),
                torch.ones(index.shape[1], dtype=torch.int32, device=device),
                accumulate=True,
            )
        prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        if prompt_pairs:
            index = torch.tensor(prompt_pairs, dtype=torch.int64, device=device).T
            prompt_mask[index[0], index[1]] = True
        penalties = torch.tensor(
            [
                [r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                for r in rows
            ],
            dtype=torch.float32,
            device=device,
        )
        fields.update(
            output_counts=counts,
            prompt_mask=prompt_mask,
            repetition_penalty=penalties[:, 0],
            frequency_penalty=penalties[:, 1],
            presence_penalty=penalties[:, 2],
        )
    if biased:
        entries = [sorted((row.params.logit_bias or {}).items()) for row in rows]
        _check_ids([t for row in entries for t, _ in row], vocab_size)
        width = max(len(row) for row in entries)
        assert width <= MAX_LOGIT_BIAS  # SamplingParams caps it
        padded = [row + [(0, 0.0)] * (width - len(row)) for row in entries]
        fields.update(
            bias_token_ids=torch.tensor(
                [[t for t, _ in row] for row in padded], dtype=torch.int64, device=device
            ),
            bias_values=torch.tensor(
                [[b for _, b in row] for row in padded], dtype=torch.float32, device=device
            ),
        )
    if min_tokens:
        stop_pairs = [
            (n, t)
            for n, row in enumerate(rows)
            for t in (
                row.stop_token_ids if row.stop_token_ids is not None else row.params.stop_token_ids
            )
        ]
        _check_ids([t for _, t in stop_pairs], vocab_size)
        stop_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        if stop_pairs:
            index = torch.tensor(stop_pairs, dtype=torch.int64, device=device).T
            stop_mask[index[0], index[1]] = True
        fields.update(
            min_tokens=torch.tensor(
                [r.params.min_tokens for r in rows], dtype=torch.int64, device=device
            ),
            stop_mask=stop_mask,
        )
    return LogitsAdjustments(**fields)


def _check_ids(token_ids: list[int], vocab_size: int) -> None:
    for token in token_ids:
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} is not in the vocabulary [0, {vocab_size})")


def _check_row(row: SamplingRow) -> None:
    if row.params.seed is None:
        raise ValueError("a SamplingRow needs a resolved seed (params.seed is None)")
    index = row.output_index
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**63:
        raise ValueError(f"output_index must be an int in [0, 2**63), got {index!r}")
