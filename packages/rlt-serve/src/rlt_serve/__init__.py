"""OpenAI-compatible HTTP frontend over the EngineClient protocol."""
