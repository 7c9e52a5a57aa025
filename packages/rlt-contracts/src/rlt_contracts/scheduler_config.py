"""`SchedulerConfig`: batching, admission, memory and exit policy, never mutated at run time;
read by the scheduler, which plans each step within it, and by the runner, which is sized by
the same limits (docs/configuration.md; each field's help: `rlt_contracts.options`)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from rlt_contracts.errors import ConfigurationError
from rlt_contracts.options import Option, check_option_values

AUTO_TICKS = "auto"  # prefill_step_decode_ticks: the model depth
# Batch sizing when not given, per device type: (max_num_seqs, max_num_batched_tokens,
# prefill_chunk_size). CUDA's is the configuration measured on an H200 (docs/results.md);
# a struct built without them takes the CPU's, the engine's options the resolved device's.
BATCH_DEFAULTS = {"cpu": (8, 128, 128), "cuda": (128, 4096, 1024)}
_CPU, _CUDA = BATCH_DEFAULTS["cpu"], BATCH_DEFAULTS["cuda"]


class SchedulingMode(enum.StrEnum):
    """How new tokens join the recurrent batch.

    REFILL     a token that exits is sampled at once and its successor starts loop 1 in the next
               tick, next to other rows at any depth (default).
    NO_REFILL  the rows decoding together form a cohort: a row whose token exited (and was
               sampled) waits until no row is looping, then all waiting rows start together.
    """

    REFILL = "refill"
    NO_REFILL = "no_refill"


class SchedulingPolicy(enum.StrEnum):
    """Admission order: FCFS (arrival) or PRIORITY (lower `priority` first, ties by arrival)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class ExitPolicyName(enum.StrEnum):
    """The exit policies (rlt_scheduler.exit_policy says what each decides)."""

    HAZARD = "hazard"
    HAZARD_DELAYED = "hazard_delayed"
    TRACE = "trace"
    FIXED = "fixed"
    LATENT_DIFF = "latent_diff"
    LATENT_DIFF_DELAYED = "latent_diff_delayed"
    KL = "kl"
    KL_DELAYED = "kl_delayed"


# Earlier names of the hazard rules, accepted wherever a policy is named (CLI, EngineConfig).
POLICY_ALIASES = {"ouro": ExitPolicyName.HAZARD, "ouro_delayed": ExitPolicyName.HAZARD_DELAYED}
POLICY_CHOICES = (*(p.value for p in ExitPolicyName), *POLICY_ALIASES)


def _sizes(index: int) -> str:
    return f"(default: {_CPU[index]} on the CPU, {_CUDA[index]} on CUDA)"


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """scheduling and batching (docs/configuration.md)

    A step holds one token row per decoding request plus prompt-chunk tokens, at most
    `max_num_batched_tokens` (> `max_num_seqs`, so that prompts progress). `whole_prompts`, set
    by the engine (no option): a prompt is computed in one step (a prefix-LM block)."""

    mode: Annotated[
        SchedulingMode,
        Option(
            "refill: an exited row's successor starts at once; no_refill: cohorts drain first",
            name="scheduling_mode",
        ),
    ] = SchedulingMode.REFILL
    max_num_seqs: Annotated[
        int | None, Option("most requests running at once " + _sizes(0), positive=True)
    ] = None
    max_num_batched_tokens: Annotated[
        int | None, Option("token budget of one step " + _sizes(1), positive=True)
    ] = None
    prefill_chunk_size: Annotated[
        int | None,
        Option(
            "prompt tokens of one request per step " + _sizes(2) + "; never above the token budget",
            positive=True,
        ),
    ] = None
    decode_ticks_per_step: Annotated[
        int,
        Option(
            "most decode loop ticks per host round trip (steps with prompt work run "
            "--prefill-step-decode-ticks)",
            positive=True,
        ),
    ] = 8
    prefill_step_decode_ticks: Annotated[
        int | Literal["auto"],
        Option(
            "decode ticks of a step that can compute prompts: N, or 'auto' (the model depth: "
            "about one token per decoding request per prompt step) (default: 1)"
        ),
    ] = 1
    scheduler_delay_factor: Annotated[
        float,
        Option(
            "F > 0: while requests run, a new prompt waits F x the latest prompt step's "
            "duration, so prompts arriving close together start together (default: 0, at once)"
        ),
    ] = 0.0
    max_waiting_requests: Annotated[
        int,
        Option("waiting-queue bound; beyond it requests are refused (HTTP 429)", positive=True),
    ] = 4096
    max_num_batched_token_loops: Annotated[
        int | None,
        Option("cap on token x loop passes per step (default: no cap)", positive=True),
    ] = None
    enable_prefix_caching: Annotated[
        bool, Option("share full prompt pages across requests, at every depth")
    ] = False
    incremental_kv: Annotated[
        bool, Option("claim KV pages as requests grow instead of a lifetime reservation")
    ] = False
    watermark_ratio: Annotated[
        float,
        Option(
            "fraction of the KV pool kept free at admission while other requests run",
            name="kv_watermark",
        ),
    ] = 0.0
    policy: Annotated[
        SchedulingPolicy,
        Option(
            "admission order: first come first served, or by request priority (lower first)",
            name="scheduling_policy",
        ),
    ] = SchedulingPolicy.FCFS
    enable_preemption: Annotated[
        bool,
        Option("under memory pressure or for priority, move requests' KV to the CPU (lossless)"),
    ] = False
    exit_policy: Annotated[
        str | None,
        Option(
            "how each token's exit loop is chosen (default: the model family's own exit "
            "signal: hazard for a gated family, latent_diff for a latent-change one, fixed "
            "depth for one without a signal; kl reads the head's distribution every loop); the "
            f"earlier names {', '.join(POLICY_ALIASES)} are aliases of the hazard rules",
            choices=POLICY_CHOICES,
        ),
    ] = None
    exit_trace: Annotated[
        str | Path | None,
        Option(
            "JSON file {request_id: [depth per output token]} for --exit-policy trace "
            "(default: none; that policy needs one)"
        ),
    ] = None
    admission_scan_limit: Annotated[
        int, Option("waiting requests admission looks at per step", positive=True)
    ] = 64
    max_admission_bypasses: Annotated[
        int,
        Option("times a request that does not fit may be overtaken by later ones", positive=True),
    ] = 8
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        check_option_values(self)
        set_field = msgspec.structs.force_setattr
        if self.max_num_seqs is None:
            set_field(self, "max_num_seqs", _CPU[0])
        if self.max_num_batched_tokens is None:
            set_field(self, "max_num_batched_tokens", _CPU[1])
        if self.prefill_chunk_size is None:
            set_field(self, "prefill_chunk_size", min(_CPU[2], self.max_num_batched_tokens))
        ticks = self.prefill_step_decode_ticks
        if ticks != AUTO_TICKS and (
            isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 1
        ):
            raise ConfigurationError(
                "prefill_step_decode_ticks",
                f"must be a positive integer or 'auto', got {ticks!r}",
            )
        delay = self.scheduler_delay_factor
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0:
            raise ConfigurationError(
                "scheduler_delay_factor", f"must be a number >= 0, got {delay!r}"
            )
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ConfigurationError(
                ("max_num_batched_tokens", "max_num_seqs"),
                f"the token budget ({self.max_num_batched_tokens}) must exceed the number of "
                f"decode rows ({self.max_num_seqs}) so prefill always progresses",
            )
        if not 0.0 <= self.watermark_ratio < 1.0:
            raise ConfigurationError(
                "kv_watermark", f"must be in [0, 1), got {self.watermark_ratio}"
            )
        if self.exit_policy == "trace" and self.exit_trace is None:
            raise ConfigurationError(
                ("exit_policy", "exit_trace"), "exit_policy 'trace' needs an exit_trace file"
            )
        if self.exit_trace is not None and self.exit_policy != "trace":
            raise ConfigurationError(
                ("exit_trace", "exit_policy"),
                f"exit_trace is only read by exit_policy 'trace', not {self.exit_policy!r}",
            )

    def prefill_step_ticks(self, model_depth: int) -> int:
        """Ticks of a step that can compute prompts (`prefill_step_decode_ticks` resolved)."""
        ticks = self.prefill_step_decode_ticks
        wanted = model_depth if ticks == AUTO_TICKS else ticks
        return min(wanted, self.decode_ticks_per_step)

    def check_depth(self, model_depth: int) -> None:
        """The token x loop cap must admit at least one prefill token next to full decode rows."""
        cap = self.max_num_batched_token_loops
        if cap is not None and cap < self.max_num_seqs + model_depth:
            raise ConfigurationError(
                ("max_num_batched_token_loops", "max_num_seqs"),
                f"{cap} token-loops cannot hold {self.max_num_seqs} decode rows plus one prefill "
                f"token at depth {model_depth}",
            )
