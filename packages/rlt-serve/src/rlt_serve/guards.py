"""Request guards (one ASGI middleware), applied in this order before any handler runs:

1. Host header (DNS-rebinding defence): when the server is bound to loopback, only
   localhost / 127.0.0.1 / [::1] Host names are accepted; otherwise 403.
2. Origin header (drive-by requests from web pages): any Origin not explicitly allowed -> 403.
3. API key: with an api_key set, every /v1/*, /internal/*, /tokenize and /detokenize request
   needs `Authorization: Bearer KEY` -> 401.
   /health, /metrics, /version and the docs stay open.
4. Body: a POST body must be JSON (`Content-Type: application/json`; a missing header counts
   as JSON) -> 415, and at most `max_body_bytes` long -> 413. The body is read here (up to the
   limit) and replayed to the app, so the limit also holds for chunked uploads without a
   Content-Length.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlt_serve.errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """The bind address only this machine can reach ("localhost" or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_KEYED_PREFIXES = ("/v1/", "/internal/")  # paths that need the API key when one is set
_KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        allowed_hosts: Sequence[str] | None,
        allowed_origins: Sequence[str],
        on_reject: Callable[[str, str], None] = lambda path, outcome: None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed_origins = set(allowed_origins)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        try:
            self._check_host(headers)
            self._check_origin(headers)
            self._check_api_key(headers, path)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                scope = self._json_scope(scope, headers)
                receive = await self._buffered_body(headers, receive)
        except APIError as error:
            self.on_reject(path, "unauthorized" if error.status == 401 else "invalid")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_host(self, headers: Headers) -> None:
        if self.allowed_hosts is None:
            return
        host = headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
        if name.lower() not in self.allowed_hosts:
            raise APIError(
                403, f"Host {host!r} is not allowed", type="permission_error", code="forbidden_host"
            )

    def _check_origin(self, headers: Headers) -> None:
        origin = headers.get("origin")
        if origin is not None and origin not in self.allowed_origins:
            raise APIError(
                403,
                f"cross-origin requests from {origin!r} are not allowed",
                type="permission_error",
                code="forbidden_origin",
            )

    def _check_api_key(self, headers: Headers, path: str) -> None:
        if self.api_key is None or not (path in _KEYED_PATHS or path.startswith(_KEYED_PREFIXES)):
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @staticmethod
    def _json_scope(scope: Scope, headers: Headers) -> Scope:
        content_type = headers.get("content-type", "").strip()
        if not content_type:
            headers_without = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            return {**scope, "headers": [*headers_without, (b"content-type", b"application/json")]}
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(
                415,
                f"the body must be JSON (Content-Type: application/json), got {media!r}",
                code="unsupported_media_type",
            )
        return scope

    async def _buffered_body(self, headers: Headers, receive: Receive) -> Receive:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while uploading
                return _replay([message], receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return _replay(
            [{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive
        )

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first returns `messages`, then defers to the server (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
