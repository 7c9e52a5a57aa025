"""Backend registry and selection against an engine's actual attention requirements (R13, R14).

Every backend declares `AttentionCapabilities`; selection compares them with the
`AttentionRequirements` (device, dtype, head dim, block size, KV layout, CUDA graphs) plus
whether the backend can run in this process at all (its optional dependency imports). "auto"
walks a fixed preference order and reports why each other backend was passed over; an explicit
name is honoured or refused with a `ConfigurationError` -- never silently replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlt_contracts import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionRequirements,
    ConfigurationError,
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
    """

    name: str
    capabilities: AttentionCapabilities
    unavailable_reason: Callable[[], str | None]
    create: Callable[[], AttentionBackend]


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
    """Outcome of selection: the constructed backend, its name, and the reasoning.

    rejected maps every other known backend to the reasons it was not chosen (a fresh dict per
    selection, for reporting only).
    """

    backend: AttentionBackend
    name: str
    reason: str
    rejected: dict[str, list[str]]


def known_backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


def incompatibilities(name: str, requirements: AttentionRequirements) -> list[str]:
    """Every reason backend `name` cannot serve `requirements` here (empty list: it can)."""
    entry = BACKENDS[name]
    unavailable = entry.unavailable_reason()
    reasons = [unavailable] if unavailable else []
    return reasons + unmet_requirements(entry.capabilities, requirements)


def select_attention_backend(
    requirements: AttentionRequirements, choice: str = "auto"
) -> BackendSelection:
    """Pick the backend for `requirements`: "auto" or one of `known_backends()`.

    Raises ConfigurationError("attention_backend", ...) for an unknown name, an explicit choice
    that cannot serve the requirements, or "auto" when no backend can.
    """
    summary = _describe(requirements)
    if choice != "auto":
        if choice not in BACKENDS:
            raise ConfigurationError(
                OPTION, f"unknown backend {choice!r}; known backends: {_known_list()} (or 'auto')"
            )
        reasons = incompatibilities(choice, requirements)
        if reasons:
            raise ConfigurationError(
                OPTION,
                f"{choice!r} cannot serve {summary}: {'; '.join(reasons)}. "
                f"Known backends: {_known_list()}",
            )
        rejected = {name: ["not requested"] for name in BACKENDS if name != choice}
        return BackendSelection(
            BACKENDS[choice].create(),
            choice,
            f"explicitly requested; compatible with {summary}",
            rejected,
        )

    reasons_by_name = {name: incompatibilities(name, requirements) for name in BACKENDS}
    compatible = [name for name in AUTO_PREFERENCE if not reasons_by_name[name]]
    if not compatible:
        details = "; ".join(
            f"{name}: {', '.join(reasons or ['not auto-selectable'])}"
            for name, reasons in reasons_by_name.items()
        )
        raise ConfigurationError(OPTION, f"no backend can serve {summary} ({details})")
    chosen = compatible[0]
    rejected: dict[str, list[str]] = {}
    for name, reasons in reasons_by_name.items():
        if name == chosen:
            continue
        if name not in AUTO_PREFERENCE:
            reasons = reasons + ["unverified adapter: never auto-selected, request it by name"]
        elif not reasons:
            reasons = [f"compatible, but {chosen!r} comes first in the auto order"]
        rejected[name] = reasons
    passed_over = AUTO_PREFERENCE[: AUTO_PREFERENCE.index(chosen)]
    because = "".join(f"; {name} rejected: {', '.join(rejected[name])}" for name in passed_over)
    reason = (
        f"auto: {chosen!r} is the first compatible backend of {' > '.join(AUTO_PREFERENCE)} "
        f"for {summary}{because}"
    )
    return BackendSelection(BACKENDS[chosen].create(), chosen, reason, rejected)


def _known_list() -> str:
    return ", ".join(BACKENDS)


def _describe(requirements: AttentionRequirements) -> str:
    r = requirements
    graphs = ", cuda graphs" if r.cuda_graphs else ""
    return (
        f"{r.device_type}/{r.dtype}, head_dim {r.head_dim}, {r.num_heads}/{r.num_kv_heads} heads, "
        f"block_size {r.block_size}, {r.kv_layout.value} KV{graphs}"
    )
