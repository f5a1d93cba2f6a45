"""What keeps one misbehaving client from stalling or exhausting the server.

- ``read_body``: a size cap (413 naming it, checked against Content-Length first and while
  reading) and a deadline for the whole upload (408); a client that leaves mid-upload ends
  quietly instead of with a traceback.
- ``guarded_h11``: uvicorn's HTTP/1.1 protocol with a deadline for the request head (slow or
  never-finished headers) and a cap on open connections, so held sockets cannot run the
  process out of file descriptors; both answer in the OpenAI error shape, then close.
- ``Guard``: API key, Host and Origin checks before any route runs (a web page in a browser
  must not drive a local server, by DNS rebinding or a no-preflight ``text/plain`` POST).
- ``install_error_handlers``: every error, routing ones (404, 405) included, as OpenAI JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serving.protocol import ApiError

log = logging.getLogger("miniserve.server")

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class ClientGone(Exception):
    """The client closed the connection before its request was complete."""


def error_response(exc: ApiError, close: bool = False) -> JSONResponse:
    headers = dict(exc.headers or {})
    if close:
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def read_body(receive, content_length: str | None, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, or ApiError 413/408, or ClientGone."""
    too_big = ApiError(413, f"request body is larger than the limit of {max_bytes} bytes "
                            f"(server.max_body_bytes)", type_="invalid_request_error")
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise too_big
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise ApiError(408, f"request body not received within {timeout_s:g} s (server.body_timeout_s)",
                           type_="timeout_error") from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _raw_json_response(status: int, reason: str, error: ApiError) -> bytes:
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def guarded_h11(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and a connection cap."""
    busy = _raw_json_response(503, "Service Unavailable", ApiError(
        503, f"too many open connections (server.max_connections={max_connections}); retry later",
        type_="unavailable"))

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()  # headers never completed: nothing to answer to

        def handle_events(self) -> None:
            super().handle_events()
            if not self._waiting_for_head():
                self._disarm()  # the head is in; the app's body deadline takes over

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # a keep-alive connection must send its next head in time too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11


class Guard:
    """ASGI middleware: API key on the API routes, Host and Origin on every route."""

    API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str | None, allowed_hosts: frozenset[str] | None,
                 allowed_origins: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts  # None: any Host (the server listens beyond loopback)
        self.allowed_origins = allowed_origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await error_response(error, close=True)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.lower() not in self.allowed_hosts:
                return ApiError(403, f"Host header {host[:64]!r} is not allowed (server.allowed_hosts)",
                                type_="permission_error")
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1") not in self.allowed_origins:
            return ApiError(403, "cross-origin requests are refused; list the origin in server.allowed_origins",
                            type_="permission_error")
        if self.api_key is not None and scope["path"].startswith(self.API_PREFIXES):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.api_key):
                return ApiError(401, "missing or wrong API key (send Authorization: Bearer <server.api_key>)",
                                type_="authentication_error")
        return None


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for what FastAPI would answer with ``{"detail": ...}`` or text."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = {404: f"no route {request.url.path[:80]!r}",
                   405: f"{request.method} is not allowed on {request.url.path[:80]!r}"}.get(exc.status_code,
                                                                                           str(exc.detail))
        return error_response(ApiError(exc.status_code, message, type_=kind, headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, "invalid request"))

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc: ClientGone):
        from starlette.responses import Response
        return Response(status_code=499)  # nobody reads it; no traceback for a client that left

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(ApiError(500, "internal server error", type_="server_error"))
