"""rlt: inference and serving runtime for recurrent looped transformers (Ouro).

The public names load on first use (PEP 562), so `rlt serve` starts its engine-core process
before the front end pays for importing torch and the engine.
"""

from rlt_contracts import FinishReason, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "FinishReason", "LLMEngine", "RequestOutput", "SamplingParams"]

_LAZY = {
    "EngineConfig": "rlt.engine.config",
    "LLMEngine": "rlt.engine.llm_engine",
    "RequestOutput": "rlt.engine.outputs",
    "LLM": "rlt.llm",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlt' has no attribute {name!r}")
