"""rlt-serve: OpenAI-compatible HTTP frontend over the `EngineClient` protocol.

`build_app(client, served_model_name=..., tokenizer=...)` returns a FastAPI app; run it with
any ASGI server (the `rlt serve` command uses uvicorn). See docs/serving.md for the API.
"""

from rlt_serve.app import DEFAULT_MAX_BODY_BYTES, build_app
from rlt_serve.guards import LOOPBACK_HOSTS, is_loopback
from rlt_serve.params import LoopDefaults
from rlt_serve.prompts import Tokenizer

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LOOPBACK_HOSTS",
    "LoopDefaults",
    "Tokenizer",
    "build_app",
    "is_loopback",
]
