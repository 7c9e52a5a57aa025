"""`EngineConfig`: the engine's options (`rlt_contracts.EngineOptions`, a tree of structs, each
validated once where it is built), with the defaults that need the resolved device.

    config = EngineConfig.from_options(device="cpu", kv_layout="shared", num_speculative_tokens=2)
    config.runner.kv_layout, config.runner.speculation.num_tokens, config.scheduler.max_num_seqs

`from_options` takes the options by their flat names (the command line's, vLLM's where they
exist: `rlt_contracts.option_fields`); docs/configuration.md lists them by struct.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlt_contracts import BATCH_DEFAULTS, EngineOptions, build_options, replace_options


def device_type(device: str) -> str:
    """ "cuda" or "cpu": the type a device option resolves to ("auto": CUDA when available)."""
    if device == "auto":
        import torch  # only to see whether "auto" means CUDA

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if str(device).startswith("cuda") else "cpu"


_SIZES = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")


class EngineConfig(EngineOptions, frozen=True, kw_only=True):
    """Options of one engine: `model`, `scheduler`, `runner` (with `speculation`), `pd` and
    the engine core's own (module doc)."""

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat options; unknown names raise ConfigurationError naming them. Batch
        sizes left unset (or None) take the device type's (`BATCH_DEFAULTS`: the CPU's, or the
        configuration measured on an H200 for CUDA); a default chunk never exceeds a given
        token budget."""
        if any(options.get(name) is None for name in _SIZES):
            seqs, tokens, chunk = BATCH_DEFAULTS[device_type(options.get("device", "auto"))]
            if options.get("max_num_seqs") is None:
                options["max_num_seqs"] = seqs
            if options.get("max_num_batched_tokens") is None:
                options["max_num_batched_tokens"] = tokens
            if options.get("prefill_chunk_size") is None:
                budget = options["max_num_batched_tokens"]
                options["prefill_chunk_size"] = (
                    min(chunk, budget) if isinstance(budget, int) else chunk
                )
        return build_options(cls, options)

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with these flat options changed (their structs validated again)."""
        return replace_options(self, options)

    def resolved_cache_dir(self) -> Path | None:
        """The cache directory start-up uses (`cache_dir`: $RLT_CACHE_DIR, else
        $XDG_CACHE_HOME/rlt, else ~/.cache/rlt); None when "off"."""
        given = self.cache_dir if self.cache_dir is not None else os.environ.get("RLT_CACHE_DIR")
        if given == "off":
            return None
        if given:
            return Path(given).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "rlt"
