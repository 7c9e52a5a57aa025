"""What every handler of one app shares: the engine client, tokenizer, settings and metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from rlt_contracts import EngineClient, ModelInfo

from rlt_serve.metrics import ServingMetrics
from rlt_serve.params import LoopDefaults
from rlt_serve.prompts import Tokenizer


@dataclass
class ServerContext:
    client: EngineClient
    tokenizer: Tokenizer
    served_model_name: str
    model_info: ModelInfo
    loop_defaults: LoopDefaults
    metrics: ServingMetrics
    engine_error: Callable[[], BaseException | None]
    chat_template: str | None = None  # the server's --chat-template (None: the tokenizer's)
    default_seed: int | None = None  # the server's --seed, for requests that give none
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs report it (special tokens kept)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
