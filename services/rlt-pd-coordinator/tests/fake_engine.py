"""A scripted stand-in for an engine instance's PD endpoints (no model, no GPU, no NIXL).

It speaks exactly the protocol the coordinator uses (wire.py): /health, /v1/models,
/internal/pd/info, /internal/pd/connect (checking the peers' compatibility, 409 naming the
fields) and /internal/pd/generate, and mimics the handoff: D reports a target and waits for
its "KV"; P "writes" it by notifying D over HTTP (`POST /fake/notify`, at the URL D published
in its transport metadata, so P can only reach D after the coordinator connected them), then
reports `done`; D then streams scripted tokens (token 0 at full depth). Closing a connection
aborts the request there, as on a real engine (`closed_early`, and `held` is emptied).

Test support, not shipped in the package. `FakeBehaviour` is mutable so tests can script
failures between requests. In-process use: `with serve_fake(FakeEngine(...)) as server:`;
`server.kill()` drops every connection at once and stops listening (a process kill, as the
network sees it). As a process (what the coordinator's supervisor can start with
`--engine-command "python PATH/fake_engine.py"`): `python PATH/fake_engine.py [MODEL]
--pd-role ROLE --port PORT [--fake-prefill-delay S] ...`; unknown (engine) flags are ignored,
the API key comes from $RLT_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hmac
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from rlt_contracts import FinishReason, ModelInfo, RequestOutputDelta, RltError
from rlt_contracts.pd import HandoffTarget, PDCompatibility, PDRole
from rlt_pd_coordinator.wire import (
    CONNECT_PATH,
    GENERATE_PATH,
    INFO_PATH,
    NDJSON,
    ConnectBody,
    GenerateBody,
    InstanceInfo,
    InstanceLoad,
    StreamError,
    StreamLine,
    encode,
)

NOTIFY_PATH = "/fake/notify"

DEFAULT_COMPATIBILITY = PDCompatibility(
    model_identity="fake-model",
    num_layers=4,
    num_loops=4,
    kv_layout="last_exited",
    dtype="bfloat16",
    block_size=16,
    num_kv_heads=4,
    head_dim=64,
    block_bytes=4 * 16 * 64 * 2 * 2,
    hidden_bytes=256 * 2,
)


# What a coordinator over fakes serves (pass it with CharTokenizer() to `Coordinator`).
FAKE_MODEL_INFO = ModelInfo(
    name="fake", path="/fake", max_model_len=1024, vocab_size=128, num_loops=4, eos_token_ids=(0,)
)


class CharTokenizer:
    """One token per character (code point mod 128); chat turns as <role>text."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeBehaviour:
    """What the fake does; change fields at any time.

    prefill_failure: None, "error" (an error line), "drop" (the connection breaks after a
      progress line), "hang" (never finishes), "reject" (HTTP 400).
    decode_failure: None, "reject" (HTTP 400 naming the prompt, context_length_exceeded),
      "unavailable" (HTTP 503), "drop" (the connection breaks after the first delta),
      "never_admit" (no target line).
    """

    tokens: tuple[int, ...] = (72, 105, 33, 63)
    depths: tuple[int, ...] = (4, 2, 3, 1)  # token 0 is reported at full depth regardless
    token_delay: float = 0.0
    prefill_delay: float = 0.0
    prefill_failure: str | None = None
    decode_failure: str | None = None
    kv_wait: float = 10.0  # D gives up on P's KV after this long (its lease)
    extra_running: int = 0  # added to the load the info endpoint reports
    extra_waiting: int = 0


class FakeEngine:
    """One fake instance; `app` is its ASGI app. Counters are read by tests."""

    def __init__(
        self,
        role: PDRole | str,
        *,
        agent: str | None = None,
        compatibility: PDCompatibility = DEFAULT_COMPATIBILITY,
        info_compatibility: PDCompatibility | None = None,
        behaviour: FakeBehaviour | None = None,
        api_key: str | None = None,
        model_name: str = "fake",
        max_model_len: int = 1024,
        num_loops: int = 4,
    ) -> None:
        self.role = PDRole(role)
        self.agent = agent or f"fake-{self.role}-{uuid.uuid4().hex[:8]}"
        self.compatibility = compatibility  # what it has (in its metadata, checked at connect)
        self.info_compatibility = info_compatibility  # what info reports (default: the same)
        self.behaviour = behaviour or FakeBehaviour()
        self.api_key = api_key
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.num_loops = num_loops
        self.url = ""  # set once it listens
        self.peers: dict[str, str] = {}  # agent -> url
        self.connect_calls: list[list[str]] = []
        self.requests: list[GenerateBody] = []
        self.held: set[str] = set()  # transfer ids holding "KV" here
        self.completed: list[str] = []
        self.closed_early: list[str] = []  # transfers whose connection closed before the end
        self._arrivals: dict[str, asyncio.Event] = {}
        self._http: httpx.AsyncClient | None = None
        self.app = self._build_app()

    # -- the protocol -------------------------------------------------------------------------
    def metadata(self) -> str:
        blob = {
            "agent": self.agent,
            "url": self.url,
            "compatibility": msgspec.structs.asdict(self.compatibility),
        }
        return base64.b64encode(json.dumps(blob).encode()).decode()

    def info(self) -> InstanceInfo:
        b = self.behaviour
        return InstanceInfo(
            role=self.role,
            agent=self.agent if self.role is not PDRole.NONE else "",
            metadata=self.metadata() if self.role is not PDRole.NONE else "",
            compatibility=self.info_compatibility or self.compatibility,
            load=InstanceLoad(
                running=len(self.held) + b.extra_running,
                waiting=b.extra_waiting,
                kv_blocks_free=100 - 10 * len(self.held),
                kv_blocks_total=100,
            ),
        )

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        app.add_middleware(_APIKeyGuard, key=lambda: self.api_key)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            card = {
                "id": self.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "rlt",
                "max_model_len": self.max_model_len,
                "num_loops": self.num_loops,
            }
            return {"object": "list", "data": [card]}

        @app.get(INFO_PATH)
        async def info():
            return Response(encode(self.info()), media_type="application/json")

        @app.post(CONNECT_PATH)
        async def connect(request: Request):
            body = msgspec.json.decode(await request.body(), type=ConnectBody)
            self.connect_calls.append(list(body.peers))
            connected = []
            for metadata in body.peers:
                peer = json.loads(base64.b64decode(metadata))
                theirs = msgspec.convert(peer["compatibility"], PDCompatibility)
                problems = self.compatibility.mismatches(theirs)
                if problems:
                    return _error(
                        409,
                        f"incompatible peer {peer['agent']}: " + "; ".join(problems),
                        code="pd_incompatible",
                    )
                self.peers[peer["agent"]] = peer["url"]
                connected.append(peer["agent"])
            return {"connected": connected}

        @app.post(NOTIFY_PATH)
        async def notify(request: Request):
            transfer_id = (await request.json())["transfer_id"]
            self._arrival(transfer_id).set()
            return {"ok": True}

        @app.post(GENERATE_PATH)
        async def generate(request: Request):
            try:
                body = msgspec.json.decode(await request.body(), type=GenerateBody)
            except (msgspec.ValidationError, msgspec.DecodeError, RltError) as exc:
                return _error(400, f"request: {exc}", param="request")
            self.requests.append(body)
            params = body.kv_transfer_params
            if params.role is not self.role:
                return _error(400, f"this instance has role {self.role}, not {params.role}")
            if self.role is PDRole.DECODE:
                return self._decode(body)
            if self.role is PDRole.PREFILL:
                return self._prefill(body)
            return _ndjson(self._tokens(body, body.kv_transfer_params.transfer_id))

        return app

    def _arrival(self, transfer_id: str) -> asyncio.Event:
        return self._arrivals.setdefault(transfer_id, asyncio.Event())

    def _decode(self, body: GenerateBody):
        b, params, request = self.behaviour, body.kv_transfer_params, body.request
        if b.decode_failure == "reject":
            return _error(
                400,
                f"prompt: the prompt is {len(request.prompt_token_ids)} tokens, too long here",
                param="prompt",
                code="context_length_exceeded",
            )
        if b.decode_failure == "unavailable":
            return _error(503, "the engine is shutting down", code="engine_unavailable")
        if params.prefill_agent not in self.peers:
            return _error(400, f"unknown prefill agent {params.prefill_agent!r} (not connected)")
        tid = params.transfer_id

        async def lines():
            self.held.add(tid)
            try:
                if b.decode_failure == "never_admit":
                    await asyncio.sleep(3600)
                target = HandoffTarget(
                    transfer_id=tid,
                    decode_agent=self.agent,
                    block_tables=((1, 2),),
                    first_token=0,
                    hidden_row=0,
                    prompt_length=len(request.prompt_token_ids),
                )
                yield StreamLine(target=target)
                try:
                    await asyncio.wait_for(self._arrival(tid).wait(), b.kv_wait)
                except TimeoutError:
                    yield StreamLine(
                        delta=_final(request.request_id, "the KV never arrived (lease expired)")
                    )
                    return
                async for line in self._tokens(body, tid, hold=False):
                    yield line
            except (asyncio.CancelledError, GeneratorExit):
                self.closed_early.append(tid)
                raise
            finally:
                self._arrivals.pop(tid, None)
                self.held.discard(tid)

        return _ndjson(lines())

    def _prefill(self, body: GenerateBody):
        b, params = self.behaviour, body.kv_transfer_params
        if b.prefill_failure == "reject":
            return _error(400, "request: rejected by the fake prefill instance", param="request")
        if params.target is None:
            return _error(400, "kv_transfer_params.target: required on a prefill instance")
        tid, target = params.transfer_id, params.target

        async def lines():
            self.held.add(tid)
            try:
                yield StreamLine(progress={"chunks_done": 1})
                if b.prefill_failure == "error":
                    yield StreamLine(
                        error=StreamError("simulated KV write failure", code="transfer_failed")
                    )
                    return
                if b.prefill_failure == "drop":
                    raise ConnectionAbortedError("simulated crash mid-transfer")
                if b.prefill_failure == "hang":
                    await asyncio.sleep(3600)
                await asyncio.sleep(b.prefill_delay)
                url = self.peers.get(target.decode_agent)
                if url is None:
                    yield StreamLine(
                        error=StreamError(f"unknown decode agent {target.decode_agent}")
                    )
                    return
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                if self._http is None:  # (one per engine: creating a client is slow)
                    self._http = httpx.AsyncClient(trust_env=False, timeout=10, verify=False)
                response = await self._http.post(
                    url + NOTIFY_PATH, json={"transfer_id": tid}, headers=headers
                )
                response.raise_for_status()
                self.completed.append(tid)  # its writes completed: P is done with it
                self.held.discard(tid)
                yield StreamLine(done={"transfer_id": tid})
            except (asyncio.CancelledError, GeneratorExit):
                if tid not in self.completed:
                    self.closed_early.append(tid)
                raise
            finally:
                self.held.discard(tid)

        return _ndjson(lines())

    async def _tokens(self, body: GenerateBody, tid: str, *, hold: bool = True):
        b, request = self.behaviour, body.request
        count = min(len(b.tokens), request.sampling.max_tokens)
        if hold:
            self.held.add(tid)
        try:
            for i in range(count):
                if b.token_delay:
                    await asyncio.sleep(b.token_delay)
                depth = self.num_loops if i == 0 else b.depths[i % len(b.depths)]
                last = i == count - 1
                yield StreamLine(
                    delta=RequestOutputDelta(
                        request_id=request.request_id,
                        token_ids=(b.tokens[i],),
                        exit_depths=(depth,),
                        text=chr(b.tokens[i]),
                        finished=last,
                        finish_reason=FinishReason.LENGTH if last else None,
                        num_prompt_tokens=len(request.prompt_token_ids),
                    )
                )
                if i == 0 and b.decode_failure == "drop" and self.role is PDRole.DECODE:
                    raise ConnectionAbortedError("simulated crash while decoding")
            self.completed.append(tid)
        except (asyncio.CancelledError, GeneratorExit):
            if hold:
                self.closed_early.append(tid)
            raise
        finally:
            if hold:
                self.held.discard(tid)


class _APIKeyGuard:
    """Bearer key on /v1, /internal and /fake (a plain ASGI middleware: a broken stream must
    reach the server as a broken connection, which BaseHTTPMiddleware would hide)."""

    def __init__(self, app, *, key) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send) -> None:
        key = self.key()
        if (
            scope["type"] == "http"
            and key
            and scope["path"].startswith(("/v1", "/internal", "/fake"))
        ):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
                response = _error(401, "missing or incorrect API key", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _final(request_id: str, error: str) -> RequestOutputDelta:
    return RequestOutputDelta(
        request_id=request_id,
        token_ids=(),
        exit_depths=(),
        finished=True,
        finish_reason=FinishReason.ABORT,
        error=error,
    )


def _ndjson(lines) -> StreamingResponse:
    async def body():
        async for line in lines:
            yield encode(line) + b"\n"

    return StreamingResponse(body(), media_type=NDJSON)


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


# -- in-process serving -----------------------------------------------------------------------
@dataclass
class FakeServer:
    engine: FakeEngine
    server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket
    killed: bool = field(default=False)

    @property
    def url(self) -> str:
        return self.engine.url

    def kill(self) -> None:
        """Drop every connection at once and stop listening, as a killed process would."""
        if self.killed:
            return
        self.killed = True
        done = threading.Event()

        def abort() -> None:
            for listener in getattr(self.server, "servers", []):
                listener.close()
            for connection in list(self.server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
            done.set()

        self.loop.call_soon_threadsafe(abort)
        done.wait(5)
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(10)

    loop: asyncio.AbstractEventLoop | None = None


@contextlib.contextmanager
def serve_fake(engine: FakeEngine) -> Iterator[FakeServer]:
    """Serve `engine` on 127.0.0.1 (a port the OS picks) in a thread until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    engine.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        engine.app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    holder: dict = {}

    def run() -> None:
        async def main() -> None:
            holder["loop"] = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True, name=f"fake-{engine.role}")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake engine did not start")
        time.sleep(0.01)
    fake = FakeServer(engine, server, thread, sock, loop=holder["loop"])
    try:
        yield fake
    finally:
        if not fake.killed:
            server.should_exit = True
            thread.join(10)
        sock.close()


@dataclass
class RunningCoordinator:
    coordinator: object  # rlt_pd_coordinator.server.Coordinator
    url: str
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop

    def call(self, coro_fn, timeout: float = 10.0):
        """Run `coro_fn()` on the coordinator's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)


@contextlib.contextmanager
def serve_coordinator(coordinator) -> Iterator[RunningCoordinator]:
    """Start `coordinator` (a `Coordinator`) and serve its front on 127.0.0.1 (a port the OS
    picks) in a thread until the block ends; startup errors are raised here."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    holder: dict = {}
    ready = threading.Event()

    def run() -> None:
        async def main() -> None:
            holder["loop"] = asyncio.get_running_loop()
            try:
                await coordinator.start()
            except BaseException as exc:
                holder["error"] = exc
                await coordinator.close()
                ready.set()
                return
            ready.set()
            try:
                await coordinator.serve(sockets=[sock])
            finally:
                await coordinator.close()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True, name="coordinator")
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the coordinator did not start")
    if "error" in holder:
        thread.join(10)
        sock.close()
        raise holder["error"]
    deadline = time.monotonic() + 10
    while coordinator.server is None or not coordinator.server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the coordinator's front did not start")
        time.sleep(0.01)
    try:
        yield RunningCoordinator(coordinator, url, thread, holder["loop"])
    finally:
        coordinator.server.should_exit = True
        thread.join(30)
        sock.close()


# -- as a process -----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlt_pd_coordinator.fake_engine")
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--pd-role", "--role", dest="role", default="none")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--fake-prefill-delay", type=float, default=0.0)
    parser.add_argument("--fake-token-delay", type=float, default=0.0)
    parser.add_argument("--fake-block-size", type=int, default=DEFAULT_COMPATIBILITY.block_size)
    parser.add_argument("--fake-num-loops", type=int, default=4)
    parser.add_argument("--fake-max-model-len", type=int, default=1024)
    args, _engine_flags = parser.parse_known_args(argv)
    engine = FakeEngine(
        args.role,
        compatibility=msgspec.structs.replace(
            DEFAULT_COMPATIBILITY, block_size=args.fake_block_size
        ),
        behaviour=FakeBehaviour(
            prefill_delay=args.fake_prefill_delay, token_delay=args.fake_token_delay
        ),
        api_key=os.environ.get("RLT_API_KEY") or None,
        model_name=os.path.basename(os.path.normpath(args.model)) if args.model else "fake",
        max_model_len=args.fake_max_model_len,
        num_loops=args.fake_num_loops,
    )
    engine.url = f"http://{args.host}:{args.port}"
    print(f"fake {engine.role} instance {engine.agent} on {engine.url}", flush=True)
    uvicorn.run(engine.app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
