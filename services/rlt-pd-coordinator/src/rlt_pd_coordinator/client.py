"""`PDEngineClient`: the `EngineClient` of a group of engine instances, over HTTP.

Per request (README.md, "One request, worked example"): `submit` opens D's generate stream
(an unreachable D is skipped for the next one; D's validation error is raised as a single
engine's), a task hands D's target to P and queues D's deltas, `stream` yields them unchanged,
`cancel` closes both connections. Router mode is the same without P. Failures end the
request's stream naming the instance (README.md, "Contracts").
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec
from rlt_contracts import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    ModelInfo,
    RequestOutputDelta,
)
from rlt_contracts.pd import HandoffTarget, KVTransferParams, PDRole
from rlt_serve.request_table import RequestTable

from rlt_pd_coordinator.cluster import Cluster, Instance
from rlt_pd_coordinator.wire import (
    GENERATE_PATH,
    GenerateBody,
    InstanceError,
    InstanceUnavailableError,
    StreamLine,
    encode,
    error_from_response,
    line_decoder,
)

logger = logging.getLogger("rlt_pd_coordinator")

CANCEL_WAIT_S = 5.0  # cancel() waits this long for both connections to be closed


@dataclass(frozen=True)
class Timeouts:
    """admission: D's `target` line after its stream opened (and each submit's wait for an
    instance's answer). transfer: from P's generate call to D's first delta (P's prefill and
    KV writes, D's activation)."""

    admission: float = 60.0
    transfer: float = 120.0


class _FlowFailure(InstanceError):
    """Ends one request with this message as its error (the instance named in it); raised
    from submit, rlt-serve answers it as an engine error (HTTP 500 with the message)."""


class _InstanceLost(_FlowFailure):
    """The instance went away mid-request (its connection broke, or its stream ended before
    the request did): the request fails with `EngineDeadError` (HTTP 503)."""


@dataclass(eq=False)
class _Flow:
    request: EngineRequest
    transfer_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode: Instance | None = None  # D, or the replica
    prefill: Instance | None = None
    responses: list[httpx.Response] = field(default_factory=list)
    task: asyncio.Task | None = None
    # the task entered its body: from then on cancelling it runs its cleanup (a task cancelled
    # before it first runs never enters its body, so it would close nothing and free nothing)
    started: bool = False
    claimed: bool = False
    finished: bool = False  # the final delta is queued
    cancelled: bool = False
    first_delta: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: int = 0  # tokens streamed so far
    lost: EngineDeadError | None = None  # raised by the stream in place of its final delta

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def body(self, role: PDRole, target: HandoffTarget | None = None) -> GenerateBody:
        """The generate call of `role`'s instance (naming P's agent once P is chosen)."""
        p = self.prefill
        agent = p.info.agent if p is not None and p.info else None
        params = KVTransferParams(role, self.transfer_id, prefill_agent=agent, target=target)
        return GenerateBody(self.request, params)


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_loops: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0


class PDEngineClient:
    """`rlt_contracts.EngineClient` over the instances of `cluster` (admitted already).

    model_info: what the front needs about the served model (the coordinator builds it from
    the model directory and the instances' /v1/models).
    """

    def __init__(
        self, cluster: Cluster, model_info: ModelInfo, *, timeouts: Timeouts | None = None
    ) -> None:
        self.cluster = cluster
        self._model_info = model_info
        self.timeouts = timeouts or Timeouts()
        self._flows: RequestTable[_Flow] = RequestTable()
        self._counters = _Counters()
        self._shutting_down = False
        self._shutdown_done = False

    @property
    def mode(self) -> str:
        return self.cluster.options.mode

    # -- EngineClient -------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """Gauges from the instances' last polled load (running / waiting on the instances
        that stream the tokens, KV blocks over every instance); counters from what this
        coordinator saw (prompt and generated tokens, decode loops, finished and aborted
        requests). Engine-internal counters (steps, preemptions, prefix cache) stay 0."""
        outputs = self.cluster.of_role(self.cluster.output_role)
        loads = [i.load for i in self.cluster.instances]
        total = sum(load.kv_blocks_total for load in loads)
        free = sum(load.kv_blocks_free for load in loads)
        c = self._counters
        return EngineStats(
            running_requests=sum(i.load.running for i in outputs),
            waiting_requests=sum(i.load.waiting for i in outputs),
            kv_blocks_total=total,
            kv_blocks_used=max(total - free, 0),
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            decode_loops=c.decode_loops,
            finished_requests=c.finished_requests,
            aborted_requests=c.aborted_requests,
        )

    def unavailable(self) -> BaseException | None:
        """Why no request can be served now (drives /health), or None."""
        if self._shutting_down:
            return EngineDeadError("the coordinator is shutting down")
        reason = self.cluster.unavailable_reason()
        return EngineDeadError(reason) if reason else None

    async def submit(self, request: EngineRequest) -> None:
        if self._shutting_down:
            raise EngineDeadError("the coordinator is shutting down")
        self._flows.check_free(request.request_id)
        flow = _Flow(request, transfer_id=uuid.uuid4().hex)
        self._flows[request.request_id] = flow
        try:
            await self._open_output(flow)
        except BaseException as exc:
            await self._close(flow)
            self._release(flow)
            self._flows.forget(request.request_id, flow)
            if isinstance(exc, _InstanceLost):
                raise EngineDeadError(str(exc)) from None
            raise
        self._counters.prompt_tokens += len(request.prompt_token_ids)
        # a cancel() that arrived while submitting is seen by the task when it starts
        flow.task = asyncio.create_task(self._run(flow), name=f"rlt-pd-{request.request_id}")

    def stream(self, request_id: str) -> AsyncIterator[RequestOutputDelta]:
        return self._deltas(self._flows.claim(request_id))

    async def cancel(self, request_id: str) -> None:
        flow = self._flows.get(request_id)
        if flow is None or flow.finished:
            return
        first = not flow.cancelled
        flow.cancelled = True
        if flow.task is not None:
            # a second cancel must not interrupt the task's closing of connections; a task
            # not started yet sees `cancelled` when it starts
            if first and flow.started:
                flow.task.cancel()
            await asyncio.wait({flow.task}, timeout=CANCEL_WAIT_S)

    async def shutdown(self) -> None:
        """Refuse new requests, abort the ones in flight (closing their connections; each
        ends with finish_reason "abort" after what it generated), stop polling and close the
        HTTP client. Idempotent."""
        self._shutting_down = True
        if self._shutdown_done:
            return
        self._shutdown_done = True
        flows = [f for f in self._flows.values() if f.task is not None and not f.task.done()]
        for flow in flows:
            if flow.started:  # (one not started yet sees _shutting_down when it starts)
                flow.task.cancel()
        if flows:
            await asyncio.wait([f.task for f in flows], timeout=CANCEL_WAIT_S)
        await self.cluster.close()

    # -- submit: open the output instance's stream --------------------------------------------
    async def _open_output(self, flow: _Flow) -> None:
        """Take credits and open D's (or the replica's) generate stream, skipping instances
        that cannot be reached; raises the engine's own error for an invalid request."""
        tried: list[Instance] = []
        while True:
            output = await self.cluster.acquire(self.cluster.output_role, exclude=tried)
            flow.decode = output
            role = PDRole.NONE
            if self.mode == "pd":
                role = PDRole.DECODE
                if flow.prefill is None:
                    flow.prefill = await self.cluster.acquire(PDRole.PREFILL)
            try:
                response = await self._open(output, flow.body(role))
            except InstanceUnavailableError as exc:
                logger.warning("request %s: %s; trying another instance", flow.request_id, exc)
                self.cluster.release(output)
                flow.decode = None
                tried.append(output)
                continue
            flow.responses.append(response)
            return

    async def _open(self, instance: Instance, body: GenerateBody) -> httpx.Response:
        """POST generate and wait for the answer's status (the stream stays open).

        The stream has no read timeout: its lines may be far apart by design (D is silent
        from its target until token 0, P until its writes are done) and the flow bounds those
        waits itself (admission and transfer timeouts). The client's read timeout, meant for
        the short info / models / connect calls, failed every handoff that took longer than
        30 s and marked a healthy instance unreachable."""
        http = self.cluster.http
        request = http.build_request(
            "POST",
            instance.url + GENERATE_PATH,
            content=encode(body),
            headers={"Content-Type": "application/json"},
            timeout=httpx.Timeout(
                connect=http.timeout.connect, read=None, write=http.timeout.write, pool=None
            ),
        )
        try:
            async with asyncio.timeout(self.timeouts.admission):
                response = await http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.cluster.mark_unreachable(instance, f"connect failed: {exc}")
            raise InstanceUnavailableError(f"cannot connect to {instance}: {exc}") from None
        except TimeoutError:
            raise _FlowFailure(
                f"{instance} did not answer within {self.timeouts.admission:g} s"
            ) from None
        except httpx.HTTPError as exc:
            self.cluster.mark_unreachable(instance, f"request failed: {exc!r}")
            raise _InstanceLost(f"the request to {instance} failed: {exc!r}") from None
        if response.status_code == 200:
            return response
        try:
            content = await response.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await response.aclose()
        error = error_from_response(response.status_code, content, str(instance))
        if isinstance(error, InstanceUnavailableError):
            self.cluster.mark_unreachable(instance, str(error))
        raise error

    # -- the request's task -------------------------------------------------------------------
    async def _run(self, flow: _Flow) -> None:
        flow.started = True
        lines = self._lines(flow.decode, flow.responses[0])
        try:
            if flow.cancelled or self._shutting_down:
                raise asyncio.CancelledError  # before this task ran: only the cleanup below
            if self.mode != "pd":
                await self._pump(flow, lines)
            else:
                await self._handoff(flow, lines)
        except asyncio.CancelledError:
            # its consumer left (`cancel`) or the coordinator shuts down (`shutdown`, after the
            # drain's grace period): the request ends as `rlt serve` ends it then, with
            # finish_reason "abort" after what it generated (a 200 with the partial text)
            self._finish(flow, error=None)
        except _FlowFailure as exc:
            self._finish(flow, error=str(exc), lost=isinstance(exc, _InstanceLost))
        except Exception as exc:  # noqa: BLE001 - a bug here must still end the stream
            logger.exception("request %s failed in the coordinator", flow.request_id)
            self._finish(flow, error=f"internal coordinator error: {exc!r}")
        finally:
            await self._close(flow)
            try:
                await lines.aclose()
            except Exception:  # noqa: BLE001 - the stream failed already; nothing to add
                pass
            self._release(flow)
            self._finish(flow, error=None)
            if flow.cancelled:  # its consumer left: nobody reads the rest
                self._flows.forget(flow.request_id, flow)

    async def _handoff(self, flow: _Flow, lines: AsyncIterator[StreamLine]) -> None:
        d, p = flow.decode, flow.prefill
        target = await self._first_line(flow, lines)
        if target is None:
            return  # D ended the request before any handoff (e.g. it aborted it)
        prefill = asyncio.create_task(self._prefill(flow, p, target))
        decode = asyncio.create_task(self._pump(flow, lines))
        try:
            await self._until_first_delta(d, p, prefill, decode, flow.first_delta)
            await decode
            if flow.tokens and not prefill.done():
                # D can decode before P hears that its last write completed: let P finish
                # normally rather than abort it (the caller has its final delta already)
                await asyncio.wait({prefill}, timeout=self.timeouts.transfer)
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
            await asyncio.gather(prefill, decode, return_exceptions=True)
        if prefill.done() and not prefill.cancelled() and (error := prefill.exception()):
            logger.warning("request %s: %s after %s started decoding", flow.request_id, error, d)

    async def _first_line(self, flow: _Flow, lines) -> HandoffTarget | None:
        d = flow.decode
        try:
            async with asyncio.timeout(self.timeouts.admission):
                first = await anext(lines, None)
        except TimeoutError:
            raise _FlowFailure(
                f"{d} did not admit the request within {self.timeouts.admission:g} s"
            ) from None
        if first is None:
            raise _InstanceLost(f"{d} ended the stream before admitting the request")
        if first.error is not None:
            raise _FlowFailure(f"{d} failed to admit the request: {_error_text(first)}")
        if first.delta is not None:
            self._push(flow, first.delta)
            if first.delta.finished:
                return None
            raise _FlowFailure(f"{d} sent tokens before its handoff target (protocol error)")
        if first.target is None:
            raise _FlowFailure(f"{d} sent no handoff target (protocol error)")
        if first.target.transfer_id != flow.transfer_id:
            raise _FlowFailure(
                f"{d} answered for transfer {first.target.transfer_id!r}, "
                f"not {flow.transfer_id!r} (protocol error)"
            )
        return first.target

    async def _until_first_delta(
        self,
        d: Instance,
        p: Instance,
        prefill: asyncio.Task,
        decode: asyncio.Task,
        first_delta: asyncio.Event,
    ) -> None:
        """Wait for D's first delta; P failing first, D failing, or the transfer timeout
        ending first fail the request."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.transfer
        arrived = asyncio.create_task(first_delta.wait())
        watched = {prefill, decode, arrived}
        try:
            while not arrived.done():
                remaining = deadline - asyncio.get_running_loop().time()
                done, _ = await asyncio.wait(
                    watched, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    step = "P's transfer" if not prefill.done() else "D's first token"
                    raise _FlowFailure(
                        f"the KV handoff from {p} to {d} did not complete within "
                        f"{self.timeouts.transfer:g} s (waiting for {step})"
                    )
                failures = []
                for task in done & {prefill, decode}:
                    watched.discard(task)
                    if task.exception() is not None:
                        failures.append(task.exception())
                if failures:  # both at once: a lost instance is the cause, not what it broke
                    lost = [e for e in failures if isinstance(e, _InstanceLost)]
                    raise (lost or failures)[0]
                if decode.done():
                    return  # D finished (e.g. aborted) without a token
        finally:
            arrived.cancel()

    async def _prefill(self, flow: _Flow, p: Instance, target: HandoffTarget) -> None:
        """P's side of the handoff: returns once P reported `done`."""
        response: httpx.Response | None = None
        try:
            try:
                response = await self._open(p, flow.body(PDRole.PREFILL, target))
            except (InstanceUnavailableError, _InstanceLost) as exc:
                raise _InstanceLost(f"the KV handoff failed: {exc}") from None
            except _FlowFailure as exc:
                raise _FlowFailure(f"the KV handoff failed: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - P refused the request
                raise _FlowFailure(f"{p} refused the prefill: {exc}") from None
            async for line in self._lines(p, response):
                if line.done is not None:
                    return
                if line.error is not None:
                    raise _FlowFailure(f"{p} failed during the KV handoff: {_error_text(line)}")
            raise _InstanceLost(f"{p} ended its stream before its KV transfer completed")
        finally:
            # done: P has finished; otherwise closing the connection aborts it on P
            if response is not None:
                await _close_quietly(response)
            if flow.prefill is p:
                flow.prefill = None
                self.cluster.release(p)

    async def _pump(self, flow: _Flow, lines: AsyncIterator[StreamLine]) -> None:
        """D's (or the replica's) deltas into the request's queue, up to the final one."""
        source = flow.decode
        async for line in lines:
            if line.delta is not None:
                self._push(flow, line.delta)
                if line.delta.finished:
                    return
            elif line.error is not None:
                raise _FlowFailure(f"{source} failed: {_error_text(line)}")
            elif line.target is not None:
                raise _FlowFailure(f"{source} sent a second handoff target (protocol error)")
        raise _InstanceLost(f"{source} ended the stream before the request finished")

    async def _lines(self, instance: Instance, response: httpx.Response):
        """The stream's lines, parsed; a broken connection or a bad line fails the request
        (and marks the instance unreachable until a poll finds it again)."""
        try:
            async for text in response.aiter_lines():
                if not text.strip():
                    continue
                try:
                    yield line_decoder.decode(text)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise _FlowFailure(f"{instance} sent an invalid stream line: {exc}") from None
        except httpx.HTTPError as exc:
            self.cluster.mark_unreachable(instance, f"connection lost: {exc!r}")
            raise _InstanceLost(
                f"lost the connection to {instance} ({type(exc).__name__}: {exc})"
            ) from None

    # -- deltas -------------------------------------------------------------------------------
    def _push(self, flow: _Flow, delta: RequestOutputDelta) -> None:
        if flow.finished:
            return
        if delta.request_id != flow.request_id:
            delta = msgspec.structs.replace(delta, request_id=flow.request_id)
        flow.queue.put_nowait(delta)
        if delta.token_ids:
            flow.first_delta.set()
            self._counters.generation_tokens += len(delta.token_ids)
            # decode loops exclude token 0 (it comes from the prompt's full-depth pass)
            self._counters.decode_loops += sum(delta.exit_depths[1 if flow.tokens == 0 else 0 :])
            flow.tokens += len(delta.token_ids)
        if delta.finished:
            flow.first_delta.set()
            flow.finished = True
            if flow.decode is not None:  # D is done with it: its credit is free right away
                self.cluster.release(flow.decode)
                flow.decode = None
            if delta.finish_reason is FinishReason.ABORT or delta.error:
                self._counters.aborted_requests += 1
            else:
                self._counters.finished_requests += 1

    def _finish(self, flow: _Flow, *, error: str | None, lost: bool = False) -> None:
        """End the stream with a final "abort" delta (carrying `error`) unless it ended;
        `lost`: an instance went away, so the stream raises `EngineDeadError(error)` instead."""
        if flow.finished:
            return
        if error:
            logger.warning("request %s failed: %s", flow.request_id, error)
        if lost and error:
            flow.lost = EngineDeadError(error)
        self._push(
            flow,
            RequestOutputDelta(
                request_id=flow.request_id,
                token_ids=(),
                exit_depths=(),
                finished=True,
                finish_reason=FinishReason.ABORT,
                num_prompt_tokens=len(flow.request.prompt_token_ids),
                error=error,
            ),
        )

    async def _deltas(self, flow: _Flow) -> AsyncIterator[RequestOutputDelta]:
        try:
            while True:
                delta = await flow.queue.get()
                if delta.finished and flow.lost is not None:
                    raise flow.lost
                yield delta
                if delta.finished:
                    return
        finally:
            if not flow.finished:
                await self.cancel(flow.request_id)
            self._flows.forget(flow.request_id, flow)

    # -- cleanup ------------------------------------------------------------------------------
    async def _close(self, flow: _Flow) -> None:
        """Close every connection of the request (the instances abort it)."""
        responses, flow.responses = flow.responses, []
        for response in responses:
            await _close_quietly(response)

    def _release(self, flow: _Flow) -> None:
        for attr in ("decode", "prefill"):
            instance = getattr(flow, attr)
            if instance is not None:
                setattr(flow, attr, None)
                self.cluster.release(instance)


def _error_text(line: StreamLine) -> str:
    error = line.error
    if error is None:
        return "unknown error"
    return f"{error.message} (code {error.code})" if error.code else error.message


async def _close_quietly(response: httpx.Response) -> None:
    try:
        await asyncio.shield(response.aclose())
    except (httpx.HTTPError, asyncio.CancelledError):
        pass
