"""`ModelRunnerOutput`: the results of executing one `SchedulerOutput` (produced by the runner).

Results are host values read back once per step. Each entry names the execution identity it
belongs to, so the scheduler drops results of requests that were cancelled meanwhile (R17).
"""

from __future__ import annotations

import msgspec

from rlt_contracts.requests import ExecutionIdentity


class GeneratedTokens(msgspec.Struct, frozen=True):
    """Consecutive output tokens of one request produced in one step, in output order.

    first_output_index: output index of token_ids[0] (0 = the token produced by prefill).
    exit_depths[i]: loops the hidden state that produced token_ids[i] went through.
    logprobs: per token, its log-probability under the model's raw distribution (log_softmax of
      the logits in fp32, before temperature / top-k / top-p); None if the request asked for none.
    top_logprobs: per token, the requested number of most likely (token_id, logprob) pairs, most
      likely first; None if the request asked for no logprobs.
    """

    identity: ExecutionIdentity
    first_output_index: int
    token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


class PrefillProgress(msgspec.Struct, frozen=True, array_like=True):
    """Prompt positions [0, end_position) of the request now hold KV at every depth."""

    identity: ExecutionIdentity
    end_position: int


class ExecutionFailure(msgspec.Struct, frozen=True):
    """The step failed for these requests (they are aborted); `message` says why."""

    identities: tuple[ExecutionIdentity, ...]
    message: str


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """Results of step `step_id`: generated tokens and prompt progress are distinct fields, so
    no caller infers meaning from the stage.

    decode_ticks: the ticks the step ran; loop_slots: rows x ticks of the decode batch the device
      ran (padding rows included), for utilisation statistics.
    """

    step_id: int
    generated: tuple[GeneratedTokens, ...] = ()
    prefill_progress: tuple[PrefillProgress, ...] = ()
    failure: ExecutionFailure | None = None
    decode_ticks: int = 0
    loop_slots: int = 0
