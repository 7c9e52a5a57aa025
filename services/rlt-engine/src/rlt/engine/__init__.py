"""The engine service: configuration, assembly of the rlt-* parts, and the engine loop.

Names load on first use (PEP 562): importing `rlt.engine.config` does not import torch.
"""

from rlt._lazy import lazy_attributes

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]

__getattr__ = lazy_attributes(
    globals(),
    {
        "EngineConfig": "rlt.engine.config",
        "LLMEngine": "rlt.engine.llm_engine",
        "RequestOutput": "rlt.engine.outputs",
    },
)
