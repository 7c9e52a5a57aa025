"""Serving: the engine thread behind `EngineClient` and the `rlt serve` wiring."""

from rlt.serving.async_engine import AsyncEngine

__all__ = ["AsyncEngine"]
