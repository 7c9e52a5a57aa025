"""Errors raised while finding or reading a model directory."""

from __future__ import annotations

from rlt_contracts import ConfigurationError, RltError


class ModelConfigError(ConfigurationError):
    """config.json is missing, malformed, of another model type, or asks for an unsupported
    feature; `options` names the offending config field(s)."""


class CheckpointError(RltError, ValueError):
    """Weights are missing, unexpected, mis-shaped or unreadable; the message names the tensor
    and the file."""


class ModelSourceError(ConfigurationError):
    """A model given by Hugging Face Hub id cannot be had: not in the cache while
    HF_HUB_OFFLINE is set, no such repository or revision, gated, or the Hub not reachable
    (`model_source.py`); `options` names `model` and / or `revision`, the message is one line."""
