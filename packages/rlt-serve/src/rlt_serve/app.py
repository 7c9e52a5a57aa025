"""`build_app`: the FastAPI application over one `EngineClient`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from rlt_contracts import EngineClient, EngineDeadError, PDControl, RltError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from rlt_serve import chat, completions
from rlt_serve.chat_template import check_chat_template
from rlt_serve.context import ServerContext
from rlt_serve.errors import (
    APIError,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from rlt_serve.guards import RequestGuard
from rlt_serve.info_routes import add_info_routes, package_version
from rlt_serve.metrics import ServingMetrics, outcome_of_status
from rlt_serve.params import LoopDefaults
from rlt_serve.pd_routes import add_pd_routes
from rlt_serve.prompts import Tokenizer
from rlt_serve.request_schemas import ChatCompletionRequest, CompletionRequest
from rlt_serve.response_schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    Health,
)
from rlt_serve.tokenize_routes import add_tokenize_routes
from rlt_serve.unexpected_errors import UnexpectedErrorsAnswered
from rlt_serve.validation_errors import handle_validation_error

DEFAULT_MAX_BODY_BYTES = 1 << 20

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid request (`error.param` names the field).",
        401: "Missing or wrong API key.",
        403: "Foreign Host or Origin header.",
        404: "Unknown model (or path).",
        413: "Body too large.",
        415: "Body is not JSON.",
        429: "Waiting queue full; retry later (Retry-After).",
        500: "Internal error.",
        503: "Engine unavailable (dead or shutting down).",
    }.items()
}


# Models only streams use; the OpenAPI schema lists them so the SSE payload is described too.
_STREAM_MODELS = (ChatCompletionChunk,)


def _sse_response(chunk_model: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": "A JSON body; with stream=true, server-sent events instead: one "
            f"`data: <{chunk_model.__name__} JSON>` line per chunk, then `data: [DONE]`.",
            "content": {
                "text/event-stream": {
                    "schema": {"$ref": f"#/components/schemas/{chunk_model.__name__}"}
                }
            },
        },
        **_ERRORS,
    }


def build_app(
    client: EngineClient,
    *,
    served_model_name: str,
    tokenizer: Tokenizer,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    loop_defaults: LoopDefaults | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    engine_error: Callable[[], BaseException | None] | None = None,
    pd: PDControl | None = None,
    version: str | None = None,
    chat_template: str | None = None,
    default_seed: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `client` (docs/serving.md describes the API).

    tokenizer: the served model's tokenizer (encode / decode / apply_chat_template).
    api_key: when set, /v1/* needs `Authorization: Bearer <api_key>`.
    max_body_bytes: larger request bodies answer 413.
    loop_defaults: min_loops / max_loops / exit_threshold for requests that omit them
      (`LoopDefaults.for_model`: checked against the model; a bad default raises
      `ConfigurationError` here, at start-up).
    allowed_hosts: accepted Host names (None: any); pass loopback names when bound to loopback.
    allowed_origins: browser origins allowed to call the API (CORS); others get 403.
    engine_error: returns why the engine stopped, or None while it runs (drives /health);
      without it, the first `EngineDeadError` a request meets marks the engine dead.
    pd: an engine instance's PD control: adds the /internal/pd/* endpoints a PD coordinator
      uses (pd_routes.py).
    version: what GET /version reports (default: rlt-serve's package version).
    chat_template: a Jinja chat template used instead of the tokenizer's (vLLM's
      --chat-template); one that does not compile is a `ConfigurationError` here.
    default_seed: the seed of requests that give none (vLLM's --seed); None: they draw one.
    Shutting the app down (lifespan end) shuts the client down.
    """
    info = client.model_info()
    if chat_template is not None:
        check_chat_template(tokenizer, chat_template)
    observed_failure: list[BaseException] = []

    def current_engine_error() -> BaseException | None:
        if engine_error is not None and (error := engine_error()) is not None:
            return error
        return observed_failure[0] if observed_failure else None

    metrics = ServingMetrics(
        client,
        model_depth=info.num_loops,
        model_name=served_model_name,
        is_alive=lambda: current_engine_error() is None,
    )
    ctx = ServerContext(
        client=client,
        tokenizer=tokenizer,
        served_model_name=served_model_name,
        model_info=info,
        loop_defaults=(loop_defaults or LoopDefaults()).for_model(info),
        metrics=metrics,
        engine_error=current_engine_error,
        chat_template=chat_template,
        default_seed=default_seed,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.shutting_down = True
        await client.shutdown()

    version = version or package_version()
    app = FastAPI(
        title="rlt OpenAI-compatible server",
        summary="Completions and chat completions from a recurrent looped transformer.",
        version=version,
        lifespan=lifespan,
    )
    app.state.rlt = ctx

    @app.post(
        completions.PATH,
        response_model=CompletionResponse,
        responses=_sse_response(CompletionResponse),
        tags=["openai"],
        summary="Create a completion",
    )
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create_completion(body, request, ctx)

    @app.post(
        chat.PATH,
        response_model=ChatCompletionResponse,
        responses=_sse_response(ChatCompletionChunk),
        tags=["openai"],
        summary="Create a chat completion",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create_chat_completion(body, request, ctx)

    add_info_routes(app, ctx, version=version, errors=_ERRORS)
    add_tokenize_routes(app, ctx, errors=_ERRORS)

    @app.get(
        "/health",
        response_model=Health,
        responses={503: {"model": Health}},
        tags=["ops"],
        summary="200 while the engine runs, 503 once it died or is shutting down",
    )
    async def health():
        error = current_engine_error()
        if error is not None:
            return JSONResponse(
                Health(status="dead", detail=str(error)).model_dump(), status_code=503
            )
        if ctx.shutting_down:
            return JSONResponse(Health(status="shutting_down").model_dump(), status_code=503)
        return Health(status="ok")

    def playground_file(name: str, media_type: str):
        async def serve_file() -> Response:
            return Response(_static_file(name), media_type=media_type, headers=_PAGE_HEADERS)

        return serve_file

    if pd is not None:
        add_pd_routes(app, client, pd)

    for path, (name, media_type) in PLAYGROUND_FILES.items():
        app.add_api_route(
            path,
            playground_file(name, media_type),
            methods=["GET"],
            include_in_schema=False,
            response_class=Response,
        )

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics (text exposition format)",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(
            await metrics.scrape(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def handle_engine_error(request: Request, exc: RltError) -> JSONResponse:
        # a client with its own `engine_error` says when the engine is gone; an EngineDeadError
        # of one request (a lost PD instance) is not the whole engine's death
        if engine_error is None and isinstance(exc, EngineDeadError) and not observed_failure:
            observed_failure.append(exc)
        return await handle_unexpected(request, exc)

    app.add_exception_handler(APIError, _counting(handle_api_error, metrics))
    app.add_exception_handler(RequestValidationError, _counting(handle_validation_error, metrics))
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
    app.add_exception_handler(RltError, _counting(handle_engine_error, metrics))
    app.add_exception_handler(Exception, _counting(handle_unexpected, metrics))
    # Innermost middleware: a bug answers a JSON 500 and the connection stays usable.
    app.add_middleware(UnexpectedErrorsAnswered, on_error=lambda path: metrics.count(path, "error"))
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        on_reject=metrics.count,
    )
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    # Outermost: runs before the guards, so that the playground's own POSTs pass the Origin
    # check (browsers send Origin even on same-origin POSTs).
    app.add_middleware(
        _SameOriginIsNoOrigin, enabled=allowed_hosts is not None or api_key is not None
    )
    app.openapi = _openapi_with_security(app, api_key is not None)
    return app


# The playground (docs/serving.md, "The playground page"): plain files shipped in the package,
# served at these paths (the page's URLs are relative, so a path prefix added by a proxy works).
PLAYGROUND_FILES: dict[str, tuple[str, str]] = {
    "/playground": ("playground.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}

# Nothing but this server: no external script, style, font or image can load, and the API
# calls may only go back to the origin that served the page.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # (no-referrer would make POSTs send "Origin: null")
    "Cache-Control": "no-cache",
}


@cache
def _static_file(name: str) -> bytes:
    return (resources.files("rlt_serve") / "static" / name).read_bytes()


class _SameOriginIsNoOrigin:
    """Treat a request whose Origin is the server's own (scheme://Host) as carrying no Origin,
    so that the playground page can call the API it was served with. Enabled only where DNS
    rebinding gains nothing: the Host header is checked (loopback) or an API key is required
    (docs/serving.md, "The playground page", Guards)."""

    def __init__(self, app: ASGIApp, *, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.enabled and scope["type"] == "http":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            host = headers.get("host")
            if origin is not None and host and _is_own_origin(origin, host):
                scope = {
                    **scope,
                    "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"origin"],
                }
        await self.app(scope, receive, send)


def _is_own_origin(origin: str, host: str) -> bool:
    origin, host = origin.strip().lower(), host.strip().lower()
    return origin in (f"http://{host}", f"https://{host}")


def _counting(handler, metrics: ServingMetrics):
    """Wrap an error handler so that the answered request is counted by its status."""

    async def counted(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        metrics.count(request.url.path, outcome_of_status(response.status_code))
        return response

    return counted


def _openapi_with_security(app: FastAPI, with_api_key: bool):
    """The generated schema, plus the bearer scheme on /v1/* when an API key is enforced."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _STREAM_MODELS:
                definition = model.model_json_schema(
                    ref_template="#/components/schemas/{model}", mode="serialization"
                )
                for name, nested in definition.pop("$defs", {}).items():
                    components.setdefault(name, nested)
                components.setdefault(model.__name__, definition)
            # Invalid bodies answer 400 with an OpenAI error body, never FastAPI's 422.
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            if with_api_key:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}
                }
                for path, operations in schema.get("paths", {}).items():
                    if path.startswith("/v1/"):
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
