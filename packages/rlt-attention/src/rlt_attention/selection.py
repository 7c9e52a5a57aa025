"""Backend registry and selection against an engine's actual attention requirements (R13, R14).

Every backend declares `AttentionCapabilities`; selection compares them with the
`AttentionRequirements` plus whether the backend can run in this process at all (its optional
dependency imports). "auto" walks a fixed preference order (capturable backends first when CUDA
graphs are requested) and reports why each other backend was passed over; an explicit name is
honoured or refused with a `ConfigurationError` naming every option involved, never silently
replaced. README.md, "Selection", has the rules and the warnings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlt_contracts import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionRequirements,
    ConfigurationError,
    UnmetRequirement,
    unmet_requirements,
)

from rlt_attention.flash_attn_backend import (
    FLASH_ATTN_CAPABILITIES,
    FlashAttnBackend,
    flash_attn_unavailable_reason,
)
from rlt_attention.torch_backend import TORCH_CAPABILITIES, TorchPagedAttention
from rlt_attention.triton_backend import (
    TRITON_CAPABILITIES,
    TritonPagedAttention,
    triton_unavailable_reason,
)

OPTION = "attention_backend"


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: static capabilities, an availability probe, and a constructor.

    unavailable_reason() -> None when the backend can be constructed in this process.
    create(batch_invariant=...) builds it (batch_invariant only where the capabilities declare
    `supports_batch_invariance`).
    """

    name: str
    capabilities: AttentionCapabilities
    unavailable_reason: Callable[[], str | None]
    create: Callable[..., AttentionBackend]


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("torch", TORCH_CAPABILITIES, lambda: None, TorchPagedAttention),
    "triton": BackendEntry(
        "triton", TRITON_CAPABILITIES, triton_unavailable_reason, TritonPagedAttention
    ),
    "flash_attn": BackendEntry(
        "flash_attn", FLASH_ATTN_CAPABILITIES, flash_attn_unavailable_reason, FlashAttnBackend
    ),
}

# "auto" takes the first compatible backend of this order. flash_attn is left out: it was never
# verified, so it runs only when requested by name.
AUTO_PREFERENCE: tuple[str, ...] = ("triton", "torch")


@dataclass(frozen=True)
class BackendSelection:
    """Outcome of selection (README.md, "Selection"): the constructed backend, its name, the
    reasoning, the reasons every other known backend was not chosen (a fresh dict, for
    reporting only), whether decode ticks can be captured as CUDA graphs (requested and
    declared), and a warning when graphs were requested but cannot be captured."""

    backend: AttentionBackend
    name: str
    reason: str
    rejected: dict[str, list[str]]
    cuda_graphs: bool = False
    warning: str | None = None


def known_backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


def unmet(name: str, requirements: AttentionRequirements) -> list[UnmetRequirement]:
    """Every reason backend `name` cannot serve `requirements` here, each naming the engine
    option to change (empty list: it can)."""
    entry = BACKENDS[name]
    unavailable = entry.unavailable_reason()
    reasons = [UnmetRequirement(OPTION, unavailable)] if unavailable else []
    reasons += unmet_requirements(entry.capabilities, requirements)
    return reasons + _unmet_sliding_window(entry.capabilities, requirements)


def _unmet_sliding_window(
    capabilities: AttentionCapabilities, requirements: AttentionRequirements
) -> list[UnmetRequirement]:
    """`requirements.sliding_window`, a hard requirement that rlt-contracts 0.3.1's
    `unmet_requirements` does not check (README.md, "Selection")."""
    if not requirements.sliding_window or capabilities.supports_sliding_window:
        return []
    return [
        UnmetRequirement(
            "model",
            f"{capabilities.name} cannot attend within a sliding window (sliding_window: a "
            "layer of this model's family passes `window`) and declares no "
            "supports_sliding_window",
        )
    ]


def incompatibilities(name: str, requirements: AttentionRequirements) -> list[str]:
    """`unmet` in plain words."""
    return [str(reason) for reason in unmet(name, requirements)]


def capturable(name: str) -> bool:
    return BACKENDS[name].capabilities.supports_cuda_graphs


def select_attention_backend(
    requirements: AttentionRequirements, choice: str = "auto"
) -> BackendSelection:
    """Pick the backend for `requirements`: "auto" or one of `known_backends()`.

    Raises ConfigurationError for an unknown name, an explicit choice that cannot serve the
    requirements (options: "attention_backend" plus every option an unmet requirement names,
    e.g. "block_size"), or "auto" when no backend can.
    """
    if choice != "auto":
        return _select_named(requirements, choice)
    summary = _describe(requirements)
    reasons_by_name = {name: incompatibilities(name, requirements) for name in BACKENDS}
    compatible = [name for name in AUTO_PREFERENCE if not reasons_by_name[name]]
    if not compatible:
        details = "; ".join(
            f"{name}: {', '.join(reasons or ['not auto-selectable'])}"
            for name, reasons in reasons_by_name.items()
        )
        raise ConfigurationError(OPTION, f"no backend can serve {summary} ({details})")
    if requirements.cuda_graphs:  # capturable backends first, each group in preference order
        compatible.sort(key=lambda name: not capturable(name))
    chosen = compatible[0]
    rejected: dict[str, list[str]] = {}
    for name, reasons in reasons_by_name.items():
        if name == chosen:
            continue
        if name not in AUTO_PREFERENCE:
            reasons = reasons + [
                "slower than triton wherever measured (H200): never auto-selected, "
                "request it by name"
            ]
        elif not reasons and requirements.cuda_graphs and not capturable(name):
            reasons = [f"compatible, but cannot be captured as CUDA graphs and {chosen!r} can"]
        elif not reasons:
            reasons = [f"compatible, but {chosen!r} comes first in the auto order"]
        rejected[name] = reasons
    graphs = requirements.cuda_graphs and capturable(chosen)
    passed_over = AUTO_PREFERENCE[: AUTO_PREFERENCE.index(chosen)]
    because = "".join(f"; {name} rejected: {', '.join(rejected[name])}" for name in passed_over)
    kind = "compatible backend that can be captured" if graphs else "compatible backend"
    reason = (
        f"auto: {chosen!r} is the first {kind} of {' > '.join(AUTO_PREFERENCE)} "
        f"for {summary}{because}"
    )
    warning = None
    if requirements.cuda_graphs and not graphs:
        others = "; ".join(
            f"{name}: {', '.join(reasons_by_name[name])}"
            for name in AUTO_PREFERENCE
            if capturable(name)
        )
        warning = (
            f"CUDA graphs were requested but no backend that can be captured serves {summary} "
            f"({others}): {chosen!r} runs and decode ticks run eagerly (slower)"
        )
    return BackendSelection(
        _create(chosen, requirements), chosen, reason, rejected, graphs, warning
    )


def _select_named(requirements: AttentionRequirements, choice: str) -> BackendSelection:
    """An explicit choice: honoured, or refused with every unmet requirement; never replaced."""
    summary = _describe(requirements)
    if choice not in BACKENDS:
        raise ConfigurationError(
            OPTION, f"unknown backend {choice!r}; known backends: {_known_list()} (or 'auto')"
        )
    reasons = unmet(choice, requirements)
    if reasons:
        options = (OPTION,) + tuple(dict.fromkeys(r.option for r in reasons if r.option != OPTION))
        raise ConfigurationError(
            options,
            f"{choice!r} cannot serve {summary}: {'; '.join(map(str, reasons))}. "
            f"Known backends: {_known_list()}",
        )
    rejected = {name: ["not requested"] for name in BACKENDS if name != choice}
    graphs = requirements.cuda_graphs and capturable(choice)
    warning = None
    if requirements.cuda_graphs and not graphs:
        alternatives = [
            name
            for name in AUTO_PREFERENCE
            if capturable(name) and not incompatibilities(name, requirements)
        ]
        hint = (
            f"'auto' or {alternatives[0]!r} would be captured"
            if alternatives
            else "no backend that can be captured serves this configuration"
        )
        warning = (
            f"attention_backend {choice!r} was requested by name and cannot be captured as CUDA "
            f"graphs: decode ticks run eagerly (slower); {hint}; cuda_graphs=False states "
            "eager decoding explicitly"
        )
    return BackendSelection(
        _create(choice, requirements),
        choice,
        f"explicitly requested; compatible with {summary}",
        rejected,
        graphs,
        warning,
    )


def _create(name: str, requirements: AttentionRequirements) -> AttentionBackend:
    return BACKENDS[name].create(batch_invariant=requirements.batch_invariant)


def _known_list() -> str:
    return ", ".join(BACKENDS)


def _describe(requirements: AttentionRequirements) -> str:
    r = requirements
    graphs = ", cuda graphs" if r.cuda_graphs else ""
    graphs += ", batch-invariant" if r.batch_invariant else ""
    graphs += ", sliding window" if r.sliding_window else ""
    return (
        f"{r.device_type}/{r.dtype}, head_dim {r.head_dim}, {r.num_heads}/{r.num_kv_heads} heads, "
        f"block_size {r.block_size}, {r.kv_layout.value} KV{graphs}"
    )
