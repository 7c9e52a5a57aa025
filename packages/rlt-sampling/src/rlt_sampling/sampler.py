"""`Sampler`: logits -> tokens (and logprobs), batched on the device, holding no state.

vLLM's V1 order (the logits adjustments, temperature, min_p, top-k / top-p), then Gumbel-max
with counter-based noise (`noise.py`): a row's token is a pure function of its logits, settings,
seed and counter. Logprobs are log_softmax of the RAW logits in fp32. README.md, "Contracts" and
"Semantics worth knowing", gives the pipeline and its rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rlt_contracts import SamplingMode, SamplingRow

from rlt_sampling.batch import SamplingBatch
from rlt_sampling.distribution import adjusted_logits, filtered_logits
from rlt_sampling.noise import STATE_DOMAIN, counter_gumbel, counter_uniform
from rlt_sampling.output import SamplerOutput
from rlt_sampling.speculative import Proposal, Verification, propose, verify


class Sampler:
    """Stateless sampler; one instance may serve every step and every device.

    compile_noise: run the counter-based Gumbel noise through `torch.compile(dynamic=True)`,
      which fuses its ~25 elementwise kernels into one (measured on an H200 at N=256,
      V=151,936: 0.33 ms instead of 4.9 ms eager; bitwise-identical results). The first call
      per device/dtype pays a compilation of seconds and needs a working compiler backend
      (Triton on CUDA; a C++ toolchain on CPU), hence off by default.
    """

    def __init__(self, *, compile_noise: bool = False) -> None:
        self._gumbel_noise = (
            torch.compile(counter_gumbel, dynamic=True) if compile_noise else counter_gumbel
        )

    def sample_rows(self, logits: torch.Tensor, *, mode: SamplingMode, **rows) -> SamplerOutput:
        """The `rlt_contracts.TokenSampler` entry (row keywords: `SamplingBatch.of_rows`): per-row
        settings already on the device (e.g. a runner's persistent row buffers), the work to do
        fixed by `mode` (host flags), so the call launches the same kernels whatever the values:
        capturable in a CUDA graph. Temperatures in (0, MIN_TEMPERATURE) are raised to it, as
        `SamplingBatch.build` does. Every row gets `mode.top_logprobs` alternatives; callers
        trim them per request. min_p is read when `mode.min_p`, `adjustments` when
        `mode.adjusts_logits`."""
        return self.sample(logits, SamplingBatch.of_rows(mode=mode, **rows))

    def state_uniforms(
        self, seed: torch.Tensor, position: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Uniforms [N, width] in (0, 1) of each row's (seed, position), apart from token noise
        (a family's random initial state; rlt_contracts.TokenSampler)."""
        return counter_uniform(seed, position, width, domain=STATE_DOMAIN)

    def propose_rows(self, logits: torch.Tensor, *, mode: SamplingMode, **rows) -> Proposal:
        """`rlt_contracts.SpeculativeSampler.propose_rows`: one draft token per row (keywords
        as `sample_rows`), from the row's draft stream (`speculative.py`)."""
        batch = SamplingBatch.of_rows(mode=mode, **rows)
        return propose(logits, batch, self._gumbel_noise)

    def verify_rows(
        self,
        target_logits: torch.Tensor,
        *,
        draft_tokens: torch.Tensor,
        draft_probabilities: torch.Tensor | None,
        drafted: torch.Tensor,
        mode: SamplingMode,
        accepted_override: torch.Tensor | None = None,
        **rows,
    ) -> Verification:
        """`rlt_contracts.SpeculativeSampler.verify_rows`: accept each row's drafts (greedy:
        equality with the target's argmax; random: rejection sampling) and add one token of the
        target distribution (`speculative.py`). Row keywords as `sample_rows`, for n rows."""
        batch = SamplingBatch.of_rows(mode=mode, **rows)
        return verify(
            target_logits,
            batch,
            draft_tokens=draft_tokens,
            draft_probabilities=draft_probabilities,
            drafted=drafted,
            noise=self._gumbel_noise,
            accepted_override=accepted_override,
        )

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch | Sequence[SamplingRow]
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [N, V] of any floating dtype (bf16/fp16/fp32); not modified.
        batch: settings of the N rows (row n describes logits row n): a `SamplingBatch` already
          on the logits' device, or the rows themselves (the `rlt_contracts.TokenSampler`
          protocol), which are then built into one with `SamplingBatch.build`.
        Returns token ids int64 [N] and, if any row asked, logprob fields (see `SamplerOutput`),
        all on the logits' device. Launches device work only; nothing is read back.
        """
        if not isinstance(batch, SamplingBatch):
            rows = batch
            if all(
                r.params.greedy and r.params.logprobs is None and not r.params.adjusts_logits
                for r in rows
            ):
                # Fast path: argmax needs no per-row settings on the device, so skip building
                # (and copying to the device) the batch tensors.
                if logits.dim() != 2 or logits.shape[0] != len(rows):
                    raise ValueError(
                        f"logits must be [N={len(rows)}, V], got {tuple(logits.shape)}"
                    )
                return SamplerOutput(logits.argmax(dim=-1), None, None, None, (None,) * len(rows))
            batch = SamplingBatch.build(rows, device=logits.device, vocab_size=logits.shape[-1])
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(
                f"logits must be [N={batch.num_rows}, V], got shape {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if logits.device != batch.device:
            raise ValueError(f"logits on {logits.device} but batch on {batch.device}")

        adjusted, greedy_token_ids = adjusted_logits(logits, batch)
        if batch.all_greedy:
            token_ids = greedy_token_ids
        else:
            gumbel = self._gumbel_noise(batch.seed, batch.counter, logits.shape[-1])
            token_ids = torch.where(
                batch.temperature == 0.0,
                greedy_token_ids,
                gumbel.add_(filtered_logits(adjusted, batch)).argmax(dim=-1),
            )
        if batch.num_top_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, batch.requested_logprobs)
        return _with_logprobs(logits, token_ids, batch)


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
) -> SamplerOutput:
    """Attach log_softmax(raw fp32 logits) of the chosen tokens and the top-k alternatives."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    num_alternatives = min(batch.num_top_logprobs, logits.shape[-1])
    top_logprobs, top_token_ids = torch.topk(logprobs, k=num_alternatives, dim=-1)
    return SamplerOutput(
        token_ids, chosen_logprobs, top_token_ids, top_logprobs, batch.requested_logprobs
    )
