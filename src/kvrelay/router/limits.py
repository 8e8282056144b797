"""Request limits: body size and read deadline, in-flight cap, draining on shutdown.

* ``read_body`` reads a request body under ``max_body_bytes`` (a larger ``Content-Length``
  is refused before reading anything; a chunked body is cut off as soon as it passes the
  limit: 413) and within ``body_timeout_s`` of the first read (408, connection closed).
* ``Guard`` is a pure ASGI middleware. Generation requests (``/v1/chat/completions``,
  ``/v1/completions``) count as in flight from their first byte until their response, streams
  included, has been sent; beyond ``max_in_flight`` the router answers 429 with
  ``Retry-After`` at once instead of queueing. While draining (SIGTERM, see
  ``router.server``) every new request gets 503, except ``/metrics`` and D's
  ``/internal/kv-report``.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvrelay.router.errors import ClientError, error_response
from kvrelay.router.metrics import RouterMetrics

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_OPEN_WHILE_DRAINING = frozenset({"/metrics", "/internal/kv-report"})
_CLOSE = {"Connection": "close"}


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes``; ``ClientError`` 413/408/400 otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ClientError("Invalid Content-Length header", headers=_CLOSE)
        if int(declared) > max_bytes:
            raise ClientError(
                f"Request body too large: the limit is {max_bytes} bytes",
                status=413, headers=_CLOSE,
            )

    async def read() -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ClientError(
                    f"Request body too large: the limit is {max_bytes} bytes",
                    status=413, headers=_CLOSE,
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout_s):  # no extra task, unlike wait_for
                return await read()
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ClientError(
            f"Request body not received within {timeout_s:g} s", status=408, headers=_CLOSE
        ) from None
    except ClientDisconnect:
        raise ClientError("Client disconnected while sending the body", headers=_CLOSE) from None


@dataclass
class GuardState:
    """Shared by the middleware and the server: what is in flight, whether we drain."""

    max_in_flight: int
    in_flight: int = 0
    draining: bool = False


class Guard:
    """The in-flight limit and the draining switch (see the module docstring)."""

    def __init__(self, app: ASGIApp, state: GuardState, metrics: RouterMetrics) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        state = self.state
        if state.draining and path not in _OPEN_WHILE_DRAINING:
            await self._reject(scope, receive, send, 503, "draining",
                               "The router is shutting down", {**_CLOSE})
            return
        if path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if state.in_flight >= state.max_in_flight:
            await self._reject(
                scope, receive, send, 429, "overload",
                f"Too many requests in flight (limit {state.max_in_flight}); retry later",
                {"Retry-After": "1"},
            )
            return
        state.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
            self.metrics.in_flight.dec()

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, status: int, reason: str,
        message: str, headers: dict[str, str],
    ) -> None:
        self.metrics.rejected.labels(reason).inc()
        path = scope.get("path", "")
        if path in GENERATION_PATHS:
            self.metrics.requests.labels(path, str(status)).inc()
        response = error_response(status, message)
        response.headers.update(headers)
        await response(scope, receive, send)
