"""`OutputProcessor`: the one owner of every request's output on the front-end side (M1).

The engine core emits, once per step, a `RequestOutputDelta` for each request that progressed:
token ids, exit depths, logprobs, finish. This module is the only place those deltas become
what a consumer reads, and each request's state lives in exactly one `RequestState`:

- its detokenizer and stop strings (`IncrementalDetokenizer`): a stop string that matches
  while the request runs ends it here; the owner of the processor sends the id back to the core
  (`process()` returns it) and the request's later tokens are dropped, its finish reason stays
  "stop";
- what the consumer has not read yet, appended in place as deltas arrive.

Consumers read one of three shapes of the same state (after vLLM's `RequestOutputKind`):
DELTA (a streaming HTTP response: each `take()` returns what is new since the previous one,
however many core deltas that covers; while the request runs the last
`len(longest stop string) - 1` characters are held back, because a later stop match could cut
them), FINAL (a non-streaming HTTP response: one `take()` once the request ended returns the
whole output; its reader is not woken before, `CoreClient.stream_final`), or CUMULATIVE, the
`output` itself (`LLMEngine.step()`: the growing `RequestOutput`).

A request is finished for its consumer only when the core's final delta arrived (after a stop
string too): by then its KV blocks are free and its timings are known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from rlt_contracts import (
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    RequestOutputDelta,
    TokenLog,
)

from rlt.engine.detokenizer import IncrementalDetokenizer
from rlt.engine.outputs import RequestOutput


class RequestState:
    """One request's output, accumulated in `output`; `take()` hands out what is new."""

    def __init__(self, request: EngineRequest, detokenizer) -> None:
        params = request.sampling
        self.request_id = request.request_id
        self.detokenizer: IncrementalDetokenizer | None = detokenizer
        longest = max((len(s) for s in params.stop), default=1)
        self._text_holdback = 0 if params.include_stop_str_in_output else longest - 1
        self.output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            tokens=TokenLog.for_request(params),
            seed=params.seed,
        )
        self.stopped = False  # a stop string matched: later tokens are dropped
        self.ended = False  # the core's final delta arrived
        self._text_taken = 0  # characters of output.text handed out by take()
        self._tokens_taken = 0  # entries of token_ids etc. handed out
        self._target_taken = False

    def apply(self, delta: RequestOutputDelta) -> bool:
        """Add one core delta; True when a stop string matched just now."""
        output = self.output
        if delta.resolved_seed is not None:
            output.seed = delta.resolved_seed
        if delta.kv_target is not None:
            output.kv_target = delta.kv_target
        if delta.prompt_logprobs is not None:
            output.prompt_logprobs = list(delta.prompt_logprobs)
            output.prompt_token_ranks = list(delta.prompt_token_ranks)
            output.prompt_top_logprobs = [
                None if top is None else list(top) for top in delta.prompt_top_logprobs
            ]
            if delta.prompt_exit_depths is not None:
                output.prompt_exit_depths = list(delta.prompt_exit_depths)
        matched = False
        if not self.stopped:
            output.tokens.extend(delta)
            detokenizer = self.detokenizer
            if detokenizer is not None:
                # the core ends a request on a stop token with that token last in its delta
                detokenizer.add_tokens(
                    delta.token_ids,
                    ends_on_stop_token=delta.finished and delta.finish_reason is FinishReason.STOP,
                )
                if detokenizer.stopped:
                    self.stopped = matched = True
                    output.finish_reason = FinishReason.STOP
                elif delta.finished:
                    detokenizer.flush()
                output.text = detokenizer.text
        if delta.finished:
            self.ended = output.finished = True
            if not self.stopped:
                output.finish_reason = delta.finish_reason
            output.error = delta.error
            output.timings = delta.timings
        return matched and not delta.finished

    def take(self) -> RequestOutputDelta:
        """What is new since the previous take."""
        output = self.output
        start, end = self._tokens_taken, len(output.token_ids)
        if self.ended or self.stopped:
            text_end = len(output.text)
        else:
            text_end = max(self._text_taken, len(output.text) - self._text_holdback)
        text = output.text[self._text_taken : text_end]
        scored = start == 0 and end > 0 and output.prompt_logprobs is not None
        target = output.kv_target if not self._target_taken else None
        self._target_taken = self._target_taken or target is not None
        self._tokens_taken, self._text_taken = end, text_end
        return RequestOutputDelta(
            **output.tokens.since(start, end),
            request_id=output.request_id,
            text=text,
            prompt_logprobs=tuple(output.prompt_logprobs) if scored else None,
            prompt_token_ranks=tuple(output.prompt_token_ranks) if scored else None,
            prompt_top_logprobs=(
                tuple(None if t is None else tuple(t) for t in output.prompt_top_logprobs)
                if scored
                else None
            ),
            prompt_exit_depths=(
                tuple(output.prompt_exit_depths)
                if scored and output.prompt_exit_depths is not None
                else None
            ),
            finished=self.ended,
            finish_reason=output.finish_reason if self.ended else None,
            num_prompt_tokens=len(output.prompt_token_ids),
            resolved_seed=output.seed,
            error=output.error,
            timings=output.timings if self.ended else None,
            kv_target=target,
        )

    def has_news(self) -> bool:
        """A DELTA take would return something (used to skip empty wake-ups)."""
        output = self.output
        return (
            self.ended
            or len(output.token_ids) > self._tokens_taken
            or (output.kv_target is not None and not self._target_taken)
            or len(output.text) - self._text_holdback > self._text_taken
        )


class OutputProcessor:
    """Detokenization, stop strings and output shapes of the requests of one front end.

    Not thread-safe: one thread adds, processes and takes (the front end's event loop, or the
    caller of `LLMEngine`).
    """

    def __init__(self, tokenizer: Callable[[], object | None], eos_token_ids: Sequence[int]):
        """`tokenizer()` returns the tokenizer, or None for token ids only (stop strings are
        refused then); it is called once, at the first request."""
        self._load_tokenizer = tokenizer
        self._eos = tuple(eos_token_ids)
        self._tokenizer = None
        self.states: dict[str, RequestState] = {}

    def add(self, requests: Sequence[EngineRequest]) -> list[RequestState]:
        """States for requests about to be submitted (raises InvalidRequestError before any is
        kept). A state replaces an earlier one of the same id only once that one ended."""
        if self._load_tokenizer is not None:
            self._tokenizer, self._load_tokenizer = self._load_tokenizer(), None
        if self._tokenizer is None and any(r.sampling.stop for r in requests):
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        for request in requests:
            live = self.states.get(request.request_id)
            if live is not None and not live.ended:
                raise InvalidRequestError(
                    "request_id", f"{request.request_id!r} is already running"
                )
        states = [RequestState(r, self._detokenizer(r)) for r in requests]
        for state in states:
            self.states[state.request_id] = state
        return states

    def _detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer | None:
        if self._tokenizer is None:
            return None
        params = request.sampling
        stop_ids = tuple(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += tuple(t for t in self._eos if t not in stop_ids)
        return IncrementalDetokenizer(
            self._tokenizer,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_token_ids=stop_ids,
            min_tokens=params.min_tokens,
        )

    def drop(self, states: Iterable[RequestState]) -> None:
        """Forget states whose requests the core refused or that a consumer finished with."""
        for state in states:
            if self.states.get(state.request_id) is state:
                del self.states[state.request_id]

    def process(
        self,
        deltas: Iterable[RequestOutputDelta],
        on_error: Callable[[str, Exception], None] | None = None,
    ) -> tuple[list[RequestState], list[str]]:
        """Apply one round of core deltas: (states with something for their consumer, ids whose
        stop string matched, to be finished in the core with reason STOP).

        on_error(request_id, error): a delta that fails to apply (a bug, e.g. in a tokenizer)
        is reported there and the round goes on with the other requests' deltas; without it
        the error propagates."""
        touched: list[RequestState] = []
        stopped: list[str] = []
        for delta in deltas:
            state = self.states.get(delta.request_id)
            if state is None or state.ended:
                continue  # a request this front end no longer follows
            try:
                matched = state.apply(delta)
            except Exception as error:
                if on_error is None:
                    raise
                on_error(delta.request_id, error)
                continue
            if matched:
                stopped.append(delta.request_id)
            touched.append(state)
        return touched, stopped
