"""rlt-models: the looped model families (Ouro, Nanbeige4.2), their registry, strict checkpoint
loading, and checkpoint writing and export.

The public names load their module on first use (PEP 562): `import rlt_models` and
`rlt_models.model_source` import no torch, so a command refuses a Hugging Face model id it
cannot resolve in about a second, before it pays for torch (2-3 s on a small CPU machine).
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "checkpoint_tensors": "rlt_models.checkpoint_export",
    "save_checkpoint": "rlt_models.checkpoint_export",
    "RandomInit": "rlt_models.checkpoint_writer",
    "random_checkpoint_tensors": "rlt_models.checkpoint_writer",
    "random_ouro_tensors": "rlt_models.checkpoint_writer",
    "write_random_checkpoint": "rlt_models.checkpoint_writer",
    "OuroConfig": "rlt_models.config",
    "DenseCausalAttention": "rlt_models.dense_attention",
    "DenseKVCache": "rlt_models.dense_attention",
    "CheckpointError": "rlt_models.errors",
    "ModelConfigError": "rlt_models.errors",
    "FAMILIES": "rlt_models.families",
    "family_for": "rlt_models.families",
    "parse_config": "rlt_models.families",
    "read_config": "rlt_models.families",
    "HrmTextConfig": "rlt_models.hrm_text",
    "HrmTextModel": "rlt_models.hrm_text",
    "build_model": "rlt_models.loading",
    "load_model": "rlt_models.loading",
    "resolve_dtype": "rlt_models.loading",
    "LoopedModelBase": "rlt_models.looped_model",
    "NanbeigeConfig": "rlt_models.nanbeige",
    "NanbeigeModel": "rlt_models.nanbeige",
    "OuroModel": "rlt_models.ouro",
    "load_tokenizer": "rlt_models.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
