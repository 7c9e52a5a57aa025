"""The engine service: configuration, assembly of the rlt-* parts, and the engine loop."""

from rlt.engine.config import EngineConfig
from rlt.engine.llm_engine import LLMEngine
from rlt.engine.outputs import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]
