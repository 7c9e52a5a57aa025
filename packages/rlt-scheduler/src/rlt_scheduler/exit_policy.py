"""Exit policies: when a decoding token stops looping (scheduler-owned decisions, R02, R04).

The scheduler owns the policy; the runner evaluates, on the device, the `ExitRule` the policy
compiles for each request (the rules' tests: `rlt_contracts.ExitRuleKind`; README.md, "Exit
policies"). "ouro" and "ouro_delayed" are aliases (`rlt_contracts.POLICY_ALIASES`). `reads`
says which `ExitSignal` a policy's rules read (None: none), so the engine can refuse a policy
the model's family does not produce; `reads_distribution`: the rules read the head's
distribution after every loop (KL).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlt_contracts import (
    POLICY_ALIASES,
    POLICY_CHOICES,
    ConfigurationError,
    ExitPolicyName,
    ExitRule,
    ExitRuleKind,
    ExitSignal,
    InvalidRequestError,
)

_OWN_POLICY = {
    ExitSignal.GATE: ExitPolicyName.HAZARD,
    ExitSignal.LATENT_CHANGE: ExitPolicyName.LATENT_DIFF,
    ExitSignal.NONE: ExitPolicyName.FIXED,
}


def default_exit_policy(signal: ExitSignal) -> str:
    """The policy of a family's own exit signal: its gate's hazard, its latent change's
    convergence test, or its fixed depth."""
    return _OWN_POLICY[signal].value


@dataclass(frozen=True)
class LoopBounds:
    """Per-request loop limits: min_loops <= exit depth <= max_loops; threshold in [0, 1]."""

    min_loops: int
    max_loops: int
    threshold: float

    @property
    def adaptive(self) -> bool:
        return self.threshold < 1.0


class ExitPolicy(Protocol):
    name: str
    reads: ExitSignal | None  # the model output its rules read
    reads_distribution: bool  # its rules read the head's distribution after every loop (KL)

    def check_request(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> None:
        """Raise InvalidRequestError if this policy cannot serve the request (at admission)."""
        ...

    def rule(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> ExitRule:
        """The request's exit rule, evaluated on the device for every loop of every token."""
        ...


class HazardExitPolicy:
    name = ExitPolicyName.HAZARD.value
    kind = ExitRuleKind.HAZARD
    reads = ExitSignal.GATE
    reads_distribution = False

    def check_request(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> None:
        return None

    def rule(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> ExitRule:
        return ExitRule(self.kind, bounds.min_loops, bounds.max_loops, bounds.threshold)


class DelayedHazardExitPolicy(HazardExitPolicy):
    """Same hazard accumulation; a trigger only schedules the exit for the next loop."""

    name = ExitPolicyName.HAZARD_DELAYED.value
    kind = ExitRuleKind.DELAYED_HAZARD


class LatentDiffExitPolicy(HazardExitPolicy):
    """Exit once a loop moves the state by less than the threshold (relative to its norm)."""

    name = ExitPolicyName.LATENT_DIFF.value
    kind = ExitRuleKind.LATENT_DIFF
    reads = ExitSignal.LATENT_CHANGE


class DelayedLatentDiffExitPolicy(LatentDiffExitPolicy):
    name = ExitPolicyName.LATENT_DIFF_DELAYED.value
    kind = ExitRuleKind.DELAYED_LATENT_DIFF


class KLExitPolicy(HazardExitPolicy):
    """Exit once a loop changes the next-token distribution by less than the threshold (KL)."""

    name = ExitPolicyName.KL.value
    kind = ExitRuleKind.KL
    reads = None  # the head's distribution, which every family produces
    reads_distribution = True


class DelayedKLExitPolicy(KLExitPolicy):
    name = ExitPolicyName.KL_DELAYED.value
    kind = ExitRuleKind.DELAYED_KL


class TraceExitPolicy:
    """Replays `depths[request_id][i]` for output token i (entry 0 is the prompt's depth: the
    request's max_loops, the model's depth unless the request asks fewer).

    A `"*"` entry (`ANY_REQUEST`) is replayed for every request the trace does not name, e.g.
    for a served load whose request ids the server makes up. The trace is checked per request
    at admission (`check_request`), so a bad trace is a request error, never a mid-generation
    failure.
    """

    ANY_REQUEST = "*"

    name = ExitPolicyName.TRACE.value
    reads = None
    reads_distribution = False

    def __init__(self, depths_by_request: Mapping[str, Sequence[int]], model_depth: int) -> None:
        self.depths = {key: tuple(value) for key, value in depths_by_request.items()}
        self.model_depth = model_depth

    @classmethod
    def from_file(cls, path: str | Path, model_depth: int) -> TraceExitPolicy:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigurationError("exit_trace", f"cannot read trace {path}: {exc}") from exc
        if not isinstance(raw, dict) or not all(
            isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v)
            for v in raw.values()
        ):
            raise ConfigurationError(
                "exit_trace", "must be a JSON object {request_id: [depth, ...]}"
            )
        return cls(raw, model_depth)

    def _depths_of(self, request_id: str) -> tuple[int, ...] | None:
        return self.depths.get(request_id, self.depths.get(self.ANY_REQUEST))

    def check_request(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> None:
        depths = self._depths_of(request_id)
        if depths is None:
            raise InvalidRequestError(
                "exit_trace", f"the trace has no depths for request {request_id!r}"
            )
        if len(depths) < max_tokens:
            raise InvalidRequestError(
                "exit_trace",
                f"{len(depths)} depths for {request_id!r} cannot cover max_tokens={max_tokens}",
            )
        if depths[0] != bounds.max_loops:
            raise InvalidRequestError(
                "exit_trace",
                f"entry 0 must be the prompt's depth, the request's max_loops {bounds.max_loops}",
            )
        bad = [d for d in depths[1:max_tokens] if not bounds.min_loops <= d <= bounds.max_loops]
        if bad:
            raise InvalidRequestError(
                "exit_trace",
                f"depths {sorted(set(bad))} of {request_id!r} are outside "
                f"[{bounds.min_loops}, {bounds.max_loops}]",
            )

    def rule(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> ExitRule:
        return ExitRule(
            ExitRuleKind.TRACE,
            bounds.min_loops,
            bounds.max_loops,
            trace_depths=self._depths_of(request_id)[:max_tokens],
        )


class FixedDepthExitPolicy:
    """A token runs exactly its request's max_loops: the policy of a family without an exit
    signal. An adaptive threshold has nothing to read there, so it is a request error."""

    name = ExitPolicyName.FIXED.value
    reads = None
    reads_distribution = False

    def check_request(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> None:
        if bounds.adaptive:
            raise InvalidRequestError(
                "exit_threshold",
                f"this model has no exit signal: every token runs max_loops loops, so "
                f"exit_threshold must be left out (or 1.0), got {bounds.threshold}",
            )

    def rule(self, request_id: str, bounds: LoopBounds, max_tokens: int) -> ExitRule:
        return ExitRule(ExitRuleKind.HAZARD, bounds.min_loops, bounds.max_loops, 1.0)


def make_exit_policy(name: str, *, exit_trace: str | Path | None, model_depth: int) -> ExitPolicy:
    """Build the engine's policy; `exit_trace` is required for, and only for, "trace"."""
    try:
        policy = POLICY_ALIASES.get(name) or ExitPolicyName(name)
    except ValueError:
        raise ConfigurationError(
            "exit_policy", f"must be one of {list(POLICY_CHOICES)}, got {name!r}"
        ) from None
    if policy is ExitPolicyName.TRACE:
        if exit_trace is None:
            raise ConfigurationError(
                ("exit_policy", "exit_trace"), "exit_policy 'trace' needs an exit_trace file"
            )
        return TraceExitPolicy.from_file(exit_trace, model_depth)
    if exit_trace is not None:
        raise ConfigurationError(
            ("exit_trace", "exit_policy"),
            f"an exit_trace is only read by exit_policy 'trace', not {name!r}",
        )
    return {
        ExitPolicyName.FIXED: FixedDepthExitPolicy,
        ExitPolicyName.HAZARD: HazardExitPolicy,
        ExitPolicyName.HAZARD_DELAYED: DelayedHazardExitPolicy,
        ExitPolicyName.LATENT_DIFF: LatentDiffExitPolicy,
        ExitPolicyName.LATENT_DIFF_DELAYED: DelayedLatentDiffExitPolicy,
        ExitPolicyName.KL: KLExitPolicy,
        ExitPolicyName.KL_DELAYED: DelayedKLExitPolicy,
    }[policy]()
