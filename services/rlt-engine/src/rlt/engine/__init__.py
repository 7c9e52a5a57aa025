"""The engine service: configuration, assembly of the rlt-* parts, and the engine loop.

Names load on first use (PEP 562): importing `rlt.engine.config` does not import torch.
"""

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]

_LAZY = {
    "EngineConfig": "rlt.engine.config",
    "LLMEngine": "rlt.engine.llm_engine",
    "RequestOutput": "rlt.engine.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlt.engine' has no attribute {name!r}")
