"""`SchedulerOutput`: what one engine step executes, as decided by the scheduler (M3).

Decoding is device-resident: a request whose prompt is done lives on the runner as a row of
persistent device state (hidden state, looping token, position, loop count, exit state), and
the scheduler hands the runner, once, the request's `DecodeRule`: its exit policy as data
(`ExitRule`) plus its stop conditions. The scheduler keeps owning the policy; the device only
evaluates it, so several loops and tokens run without a host round trip.

The runner executes a step in a fixed order every consumer may rely on: README.md, "The step
order (`SchedulerOutput`)". Positions are 0-based token positions (the prompt occupies [0, P);
generated token i is fed back at position P + i); loop indices are 1-based (loop 1 .. T).
"""

from __future__ import annotations

import enum

import msgspec

from rlt_contracts.kv import BlockTableUpdate
from rlt_contracts.requests import ExecutionIdentity
from rlt_contracts.sampling import SamplingParams
from rlt_contracts.structured import TokenMask


class ExitRuleKind(enum.StrEnum):
    """How a decoding token's exit depth is decided (loops are 1-based; token 0 never loops).

    HAZARD          exit after loop k if k >= max_loops, or if threshold < 1, k >= min_loops and
                    1 - prod_{j<=k}(1 - lambda_j) >= threshold, with lambda_j the gate's exit
                    probability sigmoid(gate(h_j)) in fp32 (the product is kept in fp64).
    DELAYED_HAZARD  the same hazard, but a trigger at loop k makes the token exit after loop k+1
                    (max_loops still wins; the extra loop's hidden state reaches coda).
    TRACE           token i exits after trace_depths[i] loops; the gate is never computed.
    LATENT_DIFF     (0.3.3) exit after loop k if k >= max_loops, or if threshold < 1, k >= min_loops
                    and the loop's latent change (ExitSignal.LATENT_CHANGE, fp32) < threshold.
    DELAYED_LATENT_DIFF  the same test, a trigger at loop k making the token exit after loop k+1.
    KL              (0.3.5) exit after loop k if k >= max_loops, or if threshold < 1, k >= min_loops
                    and KL(p_{k-1} || p_k) < threshold, p_k the next-token distribution of the
                    head after loop k (the coda run every loop), p_0 uniform over the vocabulary.
    DELAYED_KL      the same test, a trigger at loop k making the token exit after loop k+1.
    """

    HAZARD = "hazard"
    DELAYED_HAZARD = "delayed_hazard"
    TRACE = "trace"
    LATENT_DIFF = "latent_diff"
    DELAYED_LATENT_DIFF = "delayed_latent_diff"
    KL = "kl"
    DELAYED_KL = "delayed_kl"


class ExitRule(msgspec.Struct, frozen=True):
    """One request's exit policy as data (see `ExitRuleKind`): 1 <= min_loops <= max_loops <= T.

    threshold: in [0, 1]; 1.0 never triggers (fixed depth max_loops). Unused by TRACE. For the
      latent rules the exit is below it (a latent change of 1.0 or more is no convergence).
    trace_depths: TRACE only; entry i is output token i's depth (entry 0, the prefill, is T).
    """

    kind: ExitRuleKind
    min_loops: int
    max_loops: int
    threshold: float = 1.0
    trace_depths: tuple[int, ...] = ()

    @property
    def uses_gate(self) -> bool:
        """Whether a decision may read the loop's exit signal (the gate, or the latent change;
        else the runner may skip computing it)."""
        return self.kind is not ExitRuleKind.TRACE and self.threshold < 1.0

    @property
    def min_exit_depth(self) -> int:
        """The fewest loops any output token after token 0 can take (bounds tokens per tick)."""
        if self.kind is ExitRuleKind.TRACE:
            return min(self.trace_depths[1:], default=self.max_loops)
        return self.min_loops if self.threshold < 1.0 else self.max_loops


class DecodeRule(msgspec.Struct, frozen=True):
    """What the device applies on its own to a decoding row, on the scheduler's behalf.

    exit: when a token stops looping.
    max_tokens: the row stops once it has produced this many outputs (token 0 included).
    stop_token_ids: sampling one of these ends the request with reason "stop" (the model's EOS
      ids unless ignore_eos, plus the request's stop_token_ids). The scheduler applies the same
      conditions to the reported tokens and stays authoritative: a device may check only a
      prefix of a long list and keep decoding; the extra tokens are then discarded.
    one_output_per_step: structured output: after each output the row holds (no loops, no
      samples) until a step brings its next `TokenMask`; token 0 needs one too.
    num_speculative_tokens: drafts per speculative round (0.1.7); 0: the request never drafts
      and makes exactly one token per round, as a tick-by-tick decode would (the scheduler
      gives 0 to requests whose options a verify pass cannot keep, e.g. penalties).
    """

    exit: ExitRule
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    one_output_per_step: bool = False
    num_speculative_tokens: int = 0


class NewRequestData(msgspec.Struct, frozen=True):
    """Sent once, the first step a request is scheduled after admission (not after a restore).

    sampling: the request's parameters with `seed` resolved (never None here).
    prompt_length: number of prompt tokens P.
    rule: the decode rule the device applies once the prompt is done.
    prefill_only: PD prefill instance: the completed prompt keeps its final hidden state in the
      row for transfer; token 0 is not sampled here.
    prompt_token_ids: the whole prompt (P ids), also the prefix-cached part no chunk carries;
      the runner reads it only for a request with a repetition_penalty (its row's prompt mask).
    """

    identity: ExecutionIdentity
    sampling: SamplingParams
    prompt_length: int
    rule: DecodeRule
    prefill_only: bool = False
    prompt_token_ids: tuple[int, ...] = ()


class PrefillChunk(msgspec.Struct, frozen=True):
    """Prompt positions [start_position, start_position + len(token_ids)) at full depth."""

    identity: ExecutionIdentity
    start_position: int
    token_ids: tuple[int, ...]
    completes_prompt: bool

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


class RequestBlocks(msgspec.Struct, frozen=True, array_like=True):
    """Block-table growth of one request, applied by the runner before anything executes."""

    identity: ExecutionIdentity
    updates: tuple[BlockTableUpdate, ...]


class SchedulerOutput(msgspec.Struct, frozen=True):
    """Everything one engine step executes. Immutable; built by the scheduler only.

    step_id: engine-unique, increasing; echoed in `ModelRunnerOutput.step_id`.
    decode_ticks: loop ticks every decoding row runs in this step (0: decoding rows wait). The
      scheduler has made every decoding row's blocks cover the positions it can reach.
    remote_starts: PD decode instance: requests whose prompt KV and final hidden state were
      written into their blocks and row by a prefill instance; they get token 0 (coda at full
      depth) right after the bookkeeping, as if their prompt had completed here.
    token_masks: structured output: the allowed-token bitmask of the next output of
      constrained requests (after the bookkeeping, before token 0 and the ticks); each lets its
      row sample one token (`DecodeRule.one_output_per_step`).
    speculative_rounds: speculative rounds every decoding row runs in this step instead of
      ticks (0.1.7; a step has ticks or rounds, never both). A round makes between 1 and
      num_speculative_tokens + 1 outputs per row; the scheduler has made every decoding row's
      blocks cover num_speculative_tokens + 1 positions per round.
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    block_updates: tuple[RequestBlocks, ...] = ()
    released: tuple[ExecutionIdentity, ...] = ()
    snapshots: tuple[ExecutionIdentity, ...] = ()
    restores: tuple[ExecutionIdentity, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    remote_starts: tuple[ExecutionIdentity, ...] = ()
    decode_ticks: int = 0
    token_masks: tuple[TokenMask, ...] = ()
    speculative_rounds: int = 0

    @property
    def has_work(self) -> bool:
        """True if the runner must execute model work (not only bookkeeping)."""
        decodes = self.decode_ticks > 0 or self.speculative_rounds > 0
        return bool(self.prefill or self.remote_starts) or decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.prefill)
