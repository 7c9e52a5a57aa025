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

from rlt.engine.assembly import EngineParts, build_engine
from rlt.engine.config import EngineConfig
from rlt.engine.detokenizer import IncrementalDetokenizer
from rlt.engine.outputs import RequestOutput

PromptInput = str | Sequence[int]


class LLMEngine:
    """Synchronous and not thread-safe: one caller drives `step()`.

    `shutdown()` (or leaving a `with` block) aborts what runs and returns the engine's device
    memory; an engine that is garbage-collected frees its tensors too (torch's allocator keeps
    them cached for reuse, and the next engine's KV sizing counts cached memory as free).
    """

    def __init__(self, config: EngineConfig, *, model=None) -> None:
        """`model`: an `OuroModel` already loaded from `config.model` (see `build_engine`)."""
        self.config = config
        self.parts: EngineParts = build_engine(config, model=model)
        self.core = self.parts.core
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer | None] = {}
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
        self._outputs.clear()
        self._detokenizers.clear()
        self.parts = self.core = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    @cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer, loaded on first use (token-id prompts never need it)."""
        return load_tokenizer(self.parts.model_dir)

    def model_info(self) -> ModelInfo:
        shape = self.parts.model.shape
        return ModelInfo(
            name=self.parts.model_dir.name,
            path=str(self.parts.model_dir),
            max_model_len=self.parts.max_model_len,
            vocab_size=shape.vocab_size,
            num_loops=shape.num_loops,
            eos_token_ids=shape.eos_token_ids,
            weight_dtype=self.parts.weight_dtype,
            kv_cache_dtype=self.parts.kv_cache_dtype,
            kv_capacity_tokens=self.parts.kv_capacity_tokens,
        )

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
        tokenizer = self._tokenizer_or_none()
        if tokenizer is None and any(r.sampling.stop for r in requests):
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        if any(
            r.kv_transfer is not None and r.sampling.prompt_logprobs is not None for r in requests
        ):
            # the prompt is computed on the prefill instance, which reports no scores
            raise InvalidRequestError(
                "prompt_logprobs", "prompt scoring is not available through a prefill/decode pair"
            )
        for request in self.core.add_requests(requests):
            params = request.sampling
            request_id = request.identity.request_id
            self._outputs[request_id] = RequestOutput(
                request_id=request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                logprobs=[] if params.logprobs is not None else None,
                top_logprobs=[] if params.logprobs is not None else None,
                seed=params.seed,
            )
            self._detokenizers[request_id] = (
                IncrementalDetokenizer(
                    tokenizer,
                    params.stop,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop_token_ids=request.rule.stop_token_ids,
                    min_tokens=params.min_tokens,
                )
                if tokenizer is not None
                else None
            )

    def _tokenizer_or_none(self):
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

    # -- output processing ---------------------------------------------------------------------
    def _apply(self, deltas: list[RequestOutputDelta]) -> list[RequestOutput]:
        outputs = []
        for delta in deltas:
            output = self._outputs.get(delta.request_id)
            if output is None:
                continue
            self._merge(output, delta)
            outputs.append(output)
            if output.finished:
                del self._outputs[delta.request_id]
                del self._detokenizers[delta.request_id]
        return outputs

    def _merge(self, output: RequestOutput, delta: RequestOutputDelta) -> None:
        output.token_ids.extend(delta.token_ids)
        output.exit_depths.extend(delta.exit_depths)
        if delta.logprobs is not None and output.logprobs is not None:
            output.logprobs.extend(delta.logprobs)
            output.top_logprobs.extend(list(top) for top in delta.top_logprobs)
        if delta.prompt_logprobs is not None:
            output.prompt_logprobs = list(delta.prompt_logprobs)
            output.prompt_token_ranks = list(delta.prompt_token_ranks)
            output.prompt_top_logprobs = [
                None if top is None else list(top) for top in delta.prompt_top_logprobs
            ]
        detokenizer = self._detokenizers[delta.request_id]
        if detokenizer is not None:
            # The scheduler ends a request on a stop token with that token last in the delta
            # (a stop string ends it later, from here, with no new token).
            detokenizer.add_tokens(
                delta.token_ids,
                ends_on_stop_token=delta.finished and delta.finish_reason is FinishReason.STOP,
            )
            if detokenizer.stopped and not delta.finished:
                self.core.finish_request(delta.request_id, FinishReason.STOP)
                late = self.core.take_outputs()
                delta = next(d for d in late if d.request_id == delta.request_id)
            if delta.finished:
                detokenizer.flush()
            output.text = detokenizer.text
        output.finished = delta.finished
        output.finish_reason = delta.finish_reason
        output.error = delta.error
        output.timings = delta.timings
        if delta.kv_target is not None:
            output.kv_target = delta.kv_target
