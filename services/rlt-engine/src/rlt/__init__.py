"""rlt: inference and serving runtime for recurrent looped transformers (Ouro).

The public names load on first use (PEP 562), so `rlt serve` starts its engine-core process
before the front end pays for importing torch and the engine.
"""

from rlt_contracts import FinishReason, SamplingParams

from rlt._lazy import lazy_attributes

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "FinishReason", "LLMEngine", "RequestOutput", "SamplingParams"]

__getattr__ = lazy_attributes(
    globals(),
    {
        "EngineConfig": "rlt.engine.config",
        "LLMEngine": "rlt.engine.llm_engine",
        "RequestOutput": "rlt.engine.outputs",
        "LLM": "rlt.llm",
    },
)
