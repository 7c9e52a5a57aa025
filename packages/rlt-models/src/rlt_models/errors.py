"""Errors raised while reading a model directory."""

from __future__ import annotations

from rlt_contracts import ConfigurationError, RltError


class ModelConfigError(ConfigurationError):
    """config.json is missing, malformed, of another model type, or asks for an unsupported
    feature; `options` names the offending config field(s)."""


class CheckpointError(RltError, ValueError):
    """Weights are missing, unexpected, mis-shaped or unreadable; the message names the tensor
    and the file."""
