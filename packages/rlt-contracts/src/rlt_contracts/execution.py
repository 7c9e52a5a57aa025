"""`ModelRunnerOutput`: the results of executing one `SchedulerOutput` (produced by the runner).

Results are host values read back once per step. Each entry names the execution identity it
belongs to, so the scheduler drops results of requests that were cancelled meanwhile (R17).
"""

from __future__ import annotations

import enum

import msgspec

from rlt_contracts.requests import ExecutionIdentity
from rlt_contracts.tokens import TokenColumns


class GeneratedTokens(TokenColumns, frozen=True, kw_only=True):
    """Consecutive output tokens of one request produced in one step, in output order: their
    per-token columns (`TokenColumns`: ids, exit depths, logprobs) and where they start.

    first_output_index: output index of token_ids[0] (0 = the token produced by prefill).
    """

    identity: ExecutionIdentity
    first_output_index: int


class PrefillProgress(msgspec.Struct, frozen=True, array_like=True):
    """Prompt positions [0, end_position) of the request now hold KV at every depth.

    Completion evidence, not submission (R18): the runner reports it only once the device work
    that wrote those positions is known to be finished (the step's event completed, or the
    device ran it synchronously), and only for a chunk of that step.
    """

    identity: ExecutionIdentity
    end_position: int


class PromptLogprobs(msgspec.Struct, frozen=True):
    """Prompt tokens [first_token, first_token + len(token_logprobs)) of a request scored at
    full depth (`SamplingParams.prompt_logprobs`): token i's log-probability under the state of
    position i - 1, its rank there (1 = the most likely), and the `prompt_logprobs` most likely
    (token id, log-probability) pairs. Reported with the completion evidence of the chunk that
    computed them (0.1.10).

    exit_depths: with `SamplingParams.score_at_exit_depth`, aligned with token_logprobs: the
    loops the scoring state went through (token i's entry: position i - 1's exit depth under
    the request's exit rule); empty when the tokens were scored at full depth (0.1.11)."""

    identity: ExecutionIdentity
    first_token: int
    token_logprobs: tuple[float, ...]
    token_ranks: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    exit_depths: tuple[int, ...] = ()


class FailedOperation(enum.StrEnum):
    """What failed, and so what the named requests lost (R04, R06).

    SNAPSHOT  a preemption victim's state could not be saved. Its blocks were already handed to
              other requests, so it cannot resume: the scheduler aborts it with the error.
    RESTORE   a resumed request's saved state could not be written back: aborted.
    STEP      the step's shared bookkeeping or its model work raised: every request the step
              touched (chunks, decoding rows, new, restored, growing, remote starts) is aborted
              and the step reports no tokens and no progress.

    In every case the runner has already dropped the named requests' rows and snapshots and
    ignores later work for them until the scheduler releases them; other requests run on.
    """

    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    STEP = "step"


class ExecutionFailure(msgspec.Struct, frozen=True):
    """The operation failed for these requests (they are aborted); `message` says why."""

    identities: tuple[ExecutionIdentity, ...]
    message: str
    operation: FailedOperation = FailedOperation.STEP


class SpeculationCounts(msgspec.Struct, frozen=True, array_like=True):
    """Draft and acceptance counts of one step's speculative rounds (0.1.7), summed over its
    rounds and rows (vLLM's spec-decode counters).

    drafts: (row, round) pairs that proposed at least one token.
    draft_tokens / accepted_tokens: tokens proposed / accepted by the verify pass (a request that
      stopped inside a round still counts the tokens the verifier accepted).
    accepted_per_position[i]: rounds whose draft i (0-based) was accepted; its length is the
      engine's num_speculative_tokens.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """Results of step `step_id`: generated tokens and prompt progress are distinct fields, so
    no caller infers meaning from the stage.

    decode_ticks: the ticks the step ran; loop_slots: rows x ticks of the decode batch the device
      ran (padding rows included), for utilisation statistics.
    failures: what failed in the step, each naming the requests it aborts (FailedOperation);
      a SNAPSHOT or RESTORE failure leaves the other requests' results valid.
    speculative_rounds: the rounds the step ran (0.1.7); speculation: their draft and
      acceptance counts (None for a step without rounds). prompt_logprobs: scored prompt
      tokens of the step's chunks (0.1.10). A speculative step's loop_slots count
      the rows x loops of its draft passes and the positions x loops of its verify passes.
    """

    step_id: int
    generated: tuple[GeneratedTokens, ...] = ()
    prefill_progress: tuple[PrefillProgress, ...] = ()
    failures: tuple[ExecutionFailure, ...] = ()
    decode_ticks: int = 0
    loop_slots: int = 0
    speculative_rounds: int = 0
    speculation: SpeculationCounts | None = None
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()

    @property
    def step_failed(self) -> bool:
        """The whole step failed (a STEP failure): it carries no tokens and no progress."""
        return any(f.operation is FailedOperation.STEP for f in self.failures)
