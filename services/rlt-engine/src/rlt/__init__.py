"""rlt: inference and serving runtime for recurrent looped transformers (Ouro)."""

from rlt_contracts import FinishReason, SamplingParams

from rlt.engine import EngineConfig, LLMEngine, RequestOutput
from rlt.llm import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "FinishReason", "LLMEngine", "RequestOutput", "SamplingParams"]
