"""`LLMEngine`: the synchronous engine API (add_request / abort_request / step).

Wraps `EngineCore` with input processing (tokenization, validation) and output processing
(incremental detokenization, stop strings, cumulative `RequestOutput`s).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from functools import cached_property

import torch
from rlt_contracts import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    KVTransferParams,
    ModelInfo,
    RequestOutputDelta,
    SamplingParams,
)
from rlt_models import load_tokenizer

from rlt.engine.assembly import EngineParts, build_engine, model_info
from rlt.engine.config import EngineConfig
from rlt.engine.output_processor import OutputProcessor
from rlt.engine.outputs import RequestOutput

PromptInput = str | Sequence[int]


class LLMEngine:
    """Synchronous and not thread-safe: one caller drives `step()`.

    `shutdown()` (or leaving a `with` block) aborts what runs and returns the engine's device
    memory; an engine that is garbage-collected frees its tensors too (torch's allocator keeps
    them cached for reuse, and the next engine's KV sizing counts cached memory as free).
    """

    def __init__(self, config: EngineConfig, *, model=None, handoff_port=None) -> None:
        """`model`: a model (`rlt_models.LoopedModelBase`) already loaded from `config.model`;
        `handoff_port`: a PD instance's port factory instead of NIXL's (see `build_engine`)."""
        self.config = config
        self.parts: EngineParts = build_engine(config, model=model, handoff_port=handoff_port)
        self.core = self.parts.core
        self._processor = OutputProcessor(
            self.tokenizer_or_none, self.parts.model.shape.eos_token_ids
        )
        self._closed = False

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Abort every request and release the device memory (idempotent); later calls to
        the engine raise EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        device = self.parts.device
        self.core.close()
        self._processor.states.clear()
        self.parts = self.core = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    @cached_property
    def tokenizer(self):
        """The engine's tokenizer (the checkpoint's, or EngineConfig.tokenizer's), loaded on
        first use (token-id prompts never need it)."""
        return load_tokenizer(self.parts.tokenizer_source)

    def model_info(self) -> ModelInfo:
        return model_info(self.parts)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "the prompt is empty")
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            return list(prompt)
        raise InvalidRequestError(
            "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError (or a subclass) on bad
        input, leaving the engine unchanged."""
        self._check_open()
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        token_ids = self.tokenize(prompt)
        self.add_requests([EngineRequest(request_id, tuple(token_ids), params, 0.0, kv_transfer)])

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Validate and queue several tokenized requests, all or none: on any error (bad input,
        a full waiting queue) nothing was queued."""
        self._check_open()
        for request in requests:
            if not isinstance(request.sampling, SamplingParams):
                raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        states = self._processor.add(requests)
        try:
            self.core.add_requests(requests)
        except BaseException:
            self._processor.drop(states)
            raise

    def tokenizer_or_none(self):
        try:
            return self.tokenizer
        except (OSError, ValueError):  # no tokenizer files: token-id prompts still work
            return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request; returns its final output (finish reason "abort") or None if unknown."""
        if self._closed or not self.core.abort_request(request_id):
            return None
        outputs = self._apply(self.core.take_outputs())
        return next((o for o in outputs if o.request_id == request_id), None)

    def has_unfinished_requests(self) -> bool:
        return not self._closed and self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the cumulative outputs of requests that progressed."""
        self._check_open()
        return self._apply(self.core.step())

    def get_stats(self) -> EngineStats:
        self._check_open()
        return self.core.stats()

    def _apply(self, deltas: list[RequestOutputDelta]) -> list[RequestOutput]:
        """The output processor's view of a round; a stop string it matched ends its request
        in the core at once (the core's final delta then completes the output)."""
        touched, stopped = self._processor.process(deltas)
        if stopped:
            for request_id in stopped:
                self.core.finish_request(request_id, FinishReason.STOP)
            touched += self._processor.process(self.core.take_outputs())[0]
        outputs = {}
        for state in touched:
            outputs[state.request_id] = state.output
        self._processor.drop(s for s in touched if s.ended)
        return list(outputs.values())
