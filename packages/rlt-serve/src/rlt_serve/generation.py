"""Running the engine requests of one HTTP request (shared by both endpoints).

`Generation` submits one engine request per generated sequence (`best_of`, default `n`, per
prompt) together (one `submit_many` for a `BatchSubmitter`: all or none), merges their delta
streams and keeps per-choice totals. However the HTTP request ends (finished, client gone,
cancelled, failed), every engine request that has not finished is cancelled, its KV freed;
a client disconnect is watched from before the submission (README.md, "Why the ordering
matters"). Seeds, shared prompt KV and best_of's ranking: docs/serving.md, "Several choices".
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import anyio
from fastapi import Request
from msgspec import structs
from rlt_contracts import (
    BatchSubmitter,
    EngineClient,
    EngineRequest,
    FinishReason,
    RequestOutputDelta,
    SamplingParams,
    TokenLog,
    TokenLogColumns,
    requested_columns,
)
from rlt_contracts.sampling import MAX_SEED

from rlt_serve.errors import APIError, from_engine_error
from rlt_serve.metrics import ServingMetrics, outcome_of_status
from rlt_serve.response_schemas import LoopUsage, Usage


@runtime_checkable
class FinalOutputs(Protocol):
    """Optional `EngineClient` capability for non-streaming responses (vLLM's FINAL_ONLY):
    `stream_final` yields one delta holding the whole output once the request ended (README.md,
    "Contracts"); without it the deltas of `stream` are accumulated here (the same result)."""

    def stream_final(self, request_id: str) -> AsyncIterator[RequestOutputDelta]: ...


@dataclass
class Choice(TokenLogColumns):
    """Everything one choice generated so far."""

    index: int  # prompt_index * sequences per prompt + sequence
    request_id: str
    prompt_tokens: int
    prompt_index: int = 0
    # per-token columns (ids, exit depths; logprobs when the engine request asked for them)
    tokens: TokenLog = field(default_factory=TokenLog)
    text_parts: list[str] = field(default_factory=list)
    # per prompt token (None for the first) when the request scored its prompt
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_token_ranks: tuple[int | None, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    prompt_exit_depths: tuple[int | None, ...] | None = None  # with score_at_exit_depth
    finish_reason: str | None = None
    error: str | None = None
    last_token_time: float | None = None
    cancel_sent: bool = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """The engine requests of one HTTP request; use as `async with Generation(...) as g`.

    request: the HTTP request, whose client disconnect cancels everything (None: not watched).
    n / best_of: sequences returned / generated per prompt (best_of None means n).
    final_only: not streamed (a `FinalOutputs` client then sends one delta per choice).
    """

    def __init__(
        self,
        client: EngineClient,
        *,
        response_id: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        metrics: ServingMetrics,
        path: str,
        request: Request | None = None,
        field_names: dict[str, str] | None = None,
        n: int = 1,
        best_of: int | None = None,
        final_only: bool = False,
    ) -> None:
        self._client = client
        # one delta per choice, when it ended (FINAL), where the client can give it
        self._final = final_only and isinstance(client, FinalOutputs)
        self._request = request
        self._watcher: asyncio.Task | None = None
        self._metrics = metrics
        self._path = path
        self._field_names = field_names
        self.arrival = time.time()
        self._start = time.monotonic()
        self.n = n
        self.per_prompt = best_of or n
        if self.per_prompt > n and sampling.logprobs is None:
            sampling = structs.replace(sampling, logprobs=0)  # to rank by cumulative logprob
        self.sampling = sampling
        self._response_id = response_id
        self.choices = [
            Choice(
                index=p * self.per_prompt + j,
                request_id=f"{response_id}-{p * self.per_prompt + j}",
                prompt_tokens=len(ids),
                prompt_index=p,
                tokens=TokenLog.for_request(sampling),
            )
            for p, ids in enumerate(prompts)
            for j in range(self.per_prompt)
        ]
        self._prompts = prompts
        self._submitted: list[Choice] = []
        self._streams: list[AsyncIterator[RequestOutputDelta]] = []
        self.client_disconnected = False
        self.streaming = False  # set once a streaming response owns this generation
        self._outcome_recorded = False

    async def __aenter__(self) -> Generation:
        """Watch for a client disconnect, then submit every prompt; on failure cancel what was
        submitted and raise an APIError (the app's error handler answers it and counts the
        outcome)."""
        if self._request is not None:
            self._watcher = asyncio.create_task(self._watch_disconnect(self._request))
        try:
            await self._submit()
            claim = self._client.stream_final if self._final else self._client.stream
            for choice in self._submitted:
                self._streams.append(claim(choice.request_id))
            if self.client_disconnected:  # it left during the submission
                await self._cancel_unfinished()
        except BaseException as exc:
            self._stop_watching()
            await self._cancel_unfinished()
            if isinstance(exc, Exception) and not isinstance(exc, APIError):
                raise from_engine_error(exc, field_names=self._field_names) from exc
            raise
        return self

    def _engine_request(self, choice: Choice) -> EngineRequest:
        sequence = choice.index - choice.prompt_index * self.per_prompt
        sampling = self.sampling
        if sequence and sampling.seed is not None:
            sampling = structs.replace(sampling, seed=(sampling.seed + sequence) % MAX_SEED)
        group = f"{self._response_id}-p{choice.prompt_index}" if self.per_prompt > 1 else None
        return EngineRequest(
            choice.request_id,
            tuple(self._prompts[choice.prompt_index]),
            sampling,
            self.arrival,
            sibling_group=group,
        )

    async def _submit(self) -> None:
        requests = [self._engine_request(choice) for choice in self.choices]
        if isinstance(self._client, BatchSubmitter):
            await self._client.submit_many(requests)
            self._submitted.extend(self.choices)
            return
        for choice, request in zip(self.choices, requests, strict=True):
            if self.client_disconnected:
                return
            await self._client.submit(request)
            self._submitted.append(choice)

    async def __aexit__(self, exc_type, exc, _traceback) -> None:
        self._stop_watching()
        await self._cancel_unfinished()
        if self._outcome_recorded:
            return
        if isinstance(exc, Exception) and not self.streaming:
            return  # answered (and counted) by the app's error handler
        # Ended before its deltas did: the client went away (its task was cancelled, or the
        # stream could not be written any more).
        self._record("abort")

    # -- deltas --------------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[tuple[Choice, RequestOutputDelta]]:
        """(choice, delta) in arrival order across choices, each applied to its choice."""
        if len(self._streams) == 1:
            async for delta in self._streams[0]:
                yield self._apply(self.choices[0], delta), delta
        else:
            async for index, delta in _merge(self._streams):
                yield self._apply(self.choices[index], delta), delta
        self._record_finish()

    async def collect(self) -> APIError | None:
        """A non-streaming response: submit, read every delta to the end, then `failure()`."""
        async with self:
            async for _ in self.deltas():
                pass
        return self.failure()

    def _apply(self, choice: Choice, delta: RequestOutputDelta) -> Choice:
        now = time.monotonic()
        if delta.token_ids:
            if self._final:
                self._observe_final_tokens(delta, now)
            else:
                self._metrics.observe_tokens(
                    delta.exit_depths,
                    tokens_before=len(choice.token_ids),
                    last_token_time=choice.last_token_time,
                    start=self._start,
                    now=now,
                )
            choice.last_token_time = now
        choice.tokens.extend(delta)
        if delta.text:
            choice.text_parts.append(delta.text)
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
            choice.prompt_token_ranks = delta.prompt_token_ranks
            choice.prompt_top_logprobs = delta.prompt_top_logprobs
            choice.prompt_exit_depths = delta.prompt_exit_depths
        if delta.finished:
            choice.finish_reason = str(delta.finish_reason or "abort")
            choice.error = delta.error
            self._metrics.observe_finished(
                delta,
                prompt_tokens=choice.prompt_tokens,
                generated_tokens=len(choice.token_ids),
                e2e=now - self._start,
            )
        return choice

    def _observe_final_tokens(self, delta: RequestOutputDelta, now: float) -> None:
        """Token metrics of a FINAL delta (every token at once, at `now`): the first token is
        dated back by the engine's first -> last token time, the later ones share that gap
        (docs/serving.md, "Metrics"); without timings every token arrives now."""
        timings = delta.timings
        decode_s = 0.0
        if timings is not None and None not in (timings.first_token, timings.last_token):
            decode_s = max(timings.last_token - timings.first_token, 0.0)
        first = max(now - decode_s, self._start)
        depths = delta.exit_depths
        observe = self._metrics.observe_tokens
        observe(depths[:1], tokens_before=0, last_token_time=None, start=self._start, now=first)
        if len(depths) > 1:
            observe(depths[1:], tokens_before=1, last_token_time=first, start=self._start, now=now)

    # -- results -------------------------------------------------------------------------------
    def final_choices(self) -> list[Choice]:
        """The choices to return, numbered prompt_index * n + i: every sequence when
        best_of is n, otherwise each prompt's n sequences of highest cumulative log-probability,
        best first (ties keep generation order). Call once every sequence has finished."""
        if self.per_prompt == self.n:
            return list(self.choices)
        chosen = []
        for p in range(len(self._prompts)):
            sequences = [c for c in self.choices if c.prompt_index == p]
            ranked = sorted(sequences, key=lambda c: -c.cumulative_logprob)[: self.n]
            for rank, choice in enumerate(ranked):
                chosen.append(dataclasses.replace(choice, index=p * self.n + rank))
        return chosen

    def failure(self) -> APIError | None:
        """The engine failed on one of the requests (not an abort the caller asked for)."""
        for choice in self.choices:
            if choice.error:
                return APIError(
                    500, f"the engine failed on this request: {choice.error}", type="internal_error"
                )
        return None

    async def abort_open_choices(self, ended: set[int]) -> list[tuple[Choice, RequestOutputDelta]]:
        """End every choice whose last chunk did not go out (`ended`: the indexes of those whose
        did, even if its engine request finished): its engine request is cancelled if it runs,
        and it gets finish_reason "abort" and an empty final delta for its last chunk. Nothing
        is counted in the metrics: no engine result arrived."""
        await self._cancel_unfinished()
        ends = []
        empty_columns = dict.fromkeys(requested_columns(self.sampling), ())
        for choice in self.choices:
            if choice.index in ended:
                continue
            choice.finish_reason = str(FinishReason.ABORT)
            end = RequestOutputDelta(
                request_id=choice.request_id,
                finished=True,
                finish_reason=FinishReason.ABORT,
                num_prompt_tokens=choice.prompt_tokens,
                **empty_columns,
            )
            ends.append((choice, end))
        return ends

    def usage(self, model_depth: int) -> Usage:
        """Prompt tokens once per prompt; completion tokens and loops of every generated
        sequence (best_of's discarded ones included, as vLLM counts them)."""
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = sum(len(ids) for ids in self._prompts)
        decoded = [d for c in self.choices for d in c.exit_depths[1:]]
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            loops=LoopUsage(
                total_loops=sum(d for c in self.choices for d in c.exit_depths),
                mean_loops_per_token=sum(decoded) / len(decoded) if decoded else 0.0,
                model_depth=model_depth,
            ),
        )

    def record_error(self, error: APIError) -> None:
        """Count an error reported inside a stream (no error handler sees those)."""
        self._record(outcome_of_status(error.status))

    def _record_finish(self) -> None:
        reasons = {c.finish_reason for c in self.choices}
        if any(c.error for c in self.choices):
            outcome = "error"
        else:
            outcome = next((r for r in ("abort", "length", "stop") if r in reasons), "abort")
        self._record(outcome)

    def _record(self, outcome: str) -> None:
        if not self._outcome_recorded:
            self._outcome_recorded = True
            self._metrics.count(self._path, outcome)

    async def _cancel_unfinished(self) -> None:
        """Cancel every submitted, unfinished engine request, each at most once (the
        disconnect watcher and the end of the response may both get here)."""
        # Shielded: this also runs while the surrounding task is being cancelled (a client
        # disconnect cancels the streaming task), and the cancels must still go out.
        with anyio.CancelScope(shield=True):
            for choice in self._submitted:
                if not choice.finished and not choice.cancel_sent:
                    choice.cancel_sent = True
                    await self._client.cancel(choice.request_id)

    # -- client disconnects --------------------------------------------------------------------
    async def _watch_disconnect(self, request: Request) -> None:
        """A client disconnect cancels the engine requests at once (their streams then end
        with finish_reason "abort"), even before any token was sent."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.client_disconnected = True
                await self._cancel_unfinished()
                return

    def _stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not self.client_disconnected:
            watcher.cancel()  # (once the client left, it is sending the cancels: let it finish)


async def _merge(streams: list[AsyncIterator[RequestOutputDelta]]):
    """Interleave several delta streams as (stream index, delta), in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutputDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, None, exc))
        finally:
            queue.put_nowait((index, done, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is done:
                remaining -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
