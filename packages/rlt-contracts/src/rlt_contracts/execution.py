"""`ModelRunnerOutput`: the results of executing one `SchedulerOutput` (produced by the runner).

Results are host values read back once per step. Each entry names the execution identity it
belongs to, so the scheduler drops results of requests that were cancelled meanwhile (R17).
"""

from __future__ import annotations

import msgspec

from rlt_contracts.requests import ExecutionIdentity


class GateSignal(msgspec.Struct, frozen=True, array_like=True):
    """Exit-gate output after loop `loop_index` of the token at `position`.

    exit_probability: sigmoid(gate logit), computed in fp32 (the per-loop hazard lambda).
    """

    identity: ExecutionIdentity
    position: int
    loop_index: int
    exit_probability: float


class SampledToken(msgspec.Struct, frozen=True, array_like=True):
    """Output token `output_index` of a request.

    logprob: log-probability of `token_id` under the model's distribution (log_softmax of the
      raw logits in fp32, before temperature / top-k / top-p), or None if not requested.
    top_logprobs: the requested number of most likely (token_id, logprob) pairs, most likely first.
    """

    identity: ExecutionIdentity
    output_index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class PrefillProgress(msgspec.Struct, frozen=True, array_like=True):
    """Prompt positions [0, end_position) of the request now hold KV at every depth."""

    identity: ExecutionIdentity
    end_position: int


class ExecutionFailure(msgspec.Struct, frozen=True):
    """The step failed for these requests (they are aborted); `message` says why."""

    identities: tuple[ExecutionIdentity, ...]
    message: str


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """Results of step `step_id`. Gate signals, sampled tokens and prefill progress are distinct
    fields, so no caller infers meaning from the stage."""

    step_id: int
    gate_signals: tuple[GateSignal, ...] = ()
    sampled_tokens: tuple[SampledToken, ...] = ()
    prefill_progress: tuple[PrefillProgress, ...] = ()
    failure: ExecutionFailure | None = None
