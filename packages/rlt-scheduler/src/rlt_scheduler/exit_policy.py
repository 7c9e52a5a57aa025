"""Exit policies: when a decoding token stops looping (scheduler-owned decisions, R02).

Loops are 1-based. After loop k the runner reports the gate's exit probability
lambda_k = sigmoid(gate(h_k)) in fp32; the policy folds it into the token's exit state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class TokenExitState:
    """Exit progress of the token currently looping; reset when the token starts (prelude).

    survival: prod_{j<=k} (1 - lambda_j) over the loops run so far (1.0 before loop 1).
    """

    survival: float = 1.0

    @property
    def cdf(self) -> float:
        """Cumulative exit probability 1 - prod(1 - lambda_j)."""
        return 1.0 - self.survival


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

    def needs_gate(self, bounds: LoopBounds) -> bool:
        """Whether this request's exit decisions read the gate (else the runner may skip it)."""
        ...

    def after_loop(
        self, state: TokenExitState, bounds: LoopBounds, loop_index: int, exit_probability: float | None
    ) -> bool:
        """Fold loop `loop_index`'s signal into `state`; True if the token exits after it."""
        ...


class OuroExitPolicy:
    """The trained Ouro gate as a cumulative hazard, decided in the same step (synchronous).

    Exit after loop k if k >= max_loops, or if threshold < 1, k >= min_loops and
    1 - prod_{j<=k}(1 - lambda_j) >= threshold. Loops before min_loops still contribute their
    hazard. threshold == 1.0 disables adaptive exit entirely (fixed depth max_loops), even if a
    sigmoid rounds to 1.
    """

    name = "ouro"

    def needs_gate(self, bounds: LoopBounds) -> bool:
        return bounds.adaptive

    def after_loop(
        self, state: TokenExitState, bounds: LoopBounds, loop_index: int, exit_probability: float | None
    ) -> bool:
        if exit_probability is not None:
            state.survival *= 1.0 - exit_probability
        if loop_index >= bounds.max_loops:
            return True
        return (
            bounds.adaptive
            and loop_index >= bounds.min_loops
            and exit_probability is not None
            and state.cdf >= bounds.threshold
        )
