"""The ASGI application: FastAPI with the routes, the gate in front, and the error handlers.

``ServerState`` is what the routes share: the pool, the metrics, the phase (``loading`` →
``ready`` → ``draining``) and the count of generation responses in progress, which the
drain waits for. ``Gate`` (pure ASGI, so streamed responses and disconnects pass through
untouched) runs before any route: ``/v1/*`` needs ``Authorization: Bearer KEY`` when an
API key is set (401 otherwise, compared in constant time), and a body longer than
``max_body_bytes`` (by Content-Length or as it streams in) is refused with 413. Every error
— an APIError, an unknown route or method, an unexpected exception — is answered with
OpenAI's error object; a traceback goes to the server's log only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from llmc.base.version import __version__
from llmc.serve.api_errors import APIError
from llmc.serve.config import ServeConfig
from llmc.serve.engines import EnginePool
from llmc.serve.generation import RAW_SEND
from llmc.serve.metrics import ServerMetrics, outcome_of
from llmc.serve.routes import make_router

log = logging.getLogger("llmc.serve")


class ServerState:
    """The server's shared state (event-loop side)."""

    def __init__(self, config: ServeConfig, pool: EnginePool) -> None:
        self.config, self.pool = config, pool
        self.metrics = ServerMetrics(pool.replicas)
        self.phase = "loading"
        self.started = int(time.time())
        self.active = 0
        self._idle: asyncio.Event | None = None

    def request_started(self) -> None:
        self.active += 1

    def request_done(self, outcome: str) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Wait until no generation is in progress (True) or ``timeout`` s passed (False)."""
        if self.active == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return self.active == 0
        finally:
            self._idle = None


class Gate:
    """Auth and body-size checks in front of the app (see the module docstring)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.config.api_key
        self._key = None if key is None else f"Bearer {key}".encode()
        self._limit = state.config.max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._key is not None and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                return await self._refuse(
                    send,
                    APIError(401, "missing or incorrect API key: send Authorization: Bearer "
                             "<key>", code="invalid_api_key"),
                )  # fmt: skip
        length = dict(scope["headers"]).get(b"content-length")
        limit = self._limit
        if length is not None and not length.isdigit():
            return await self._refuse(send, APIError(400, "Content-Length is not a number"))
        if length is not None and int(length) > limit:
            return await self._refuse(send, self._too_large())
        seen = 0
        started = False

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # answered by the app's APIError handler
                    raise self._too_large()
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        scope[RAW_SEND] = send  # streamed chunks skip the per-message wrappers
        try:
            await self.app(scope, counted_receive, tracked_send)
        except APIError as e:  # raised outside a route (nothing else answers it)
            if not started:
                await self._refuse(send, e)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than {self._limit} bytes (--max_body_bytes)",
            code="request_too_large",
        )

    async def _refuse(self, send: Any, error: APIError) -> None:
        self.state.metrics.outcome("", outcome_of(error.status))
        body = error.body_bytes()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _json_error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def create_app(state: ServerState) -> Any:
    """The ASGI app of one server: FastAPI routes behind the Gate."""
    app = FastAPI(title="llmc serve", version=__version__, docs_url=None, redoc_url=None)
    app.include_router(make_router(state))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _json_error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _json_error(APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        state.metrics.outcome("", "server_error")
        return _json_error(APIError(500, "internal error while serving the request"))

    return Gate(app, state)
