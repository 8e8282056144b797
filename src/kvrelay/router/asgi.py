"""The router's HTTP surface on raw ASGI: requests, bodies under limits, responses, routes.

Why not a web framework: on the turn path every microsecond is the router's own CPU, and a
framework's request objects, middleware stack and streaming machinery (a task group per
streamed response) cost several times the work of relaying a turn. What the router needs is
small: headers as a dict, a body read under a size limit and a deadline, JSON and streamed
responses, a route table with OpenAI-style 404/405, and cancellation of the serving task when
its client goes away (``DisconnectWatch``). Any ASGI server can run it (uvicorn does, see
``router.server``); tests call it in process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvrelay.router.errors import ClientError, error_json, refusal_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"
SSE = b"text/event-stream"
_CLOSE = {"Connection": "close"}


class Request:
    """One HTTP request: method, path, lower-case headers; the body is read with
    ``read_body``."""

    __slots__ = ("headers", "method", "path", "receive", "scope", "send")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
        }


Handler = Callable[[Request], Awaitable[None]]


class BodyBudget:
    """The bytes of request bodies being received at once, across requests, at most
    ``limit_bytes``. A generation request takes its in-flight slot only once its body has
    arrived (so a client that sends a head and then nothing, or trickles its body, holds no
    slot and locks nobody out); what bodies still arriving hold is bounded here instead, by
    what their clients have actually sent."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, num_bytes: int) -> None:
        """Hold ``num_bytes`` more, or ``ClientError`` 503 (the router is receiving too
        much at once)."""
        if self.held_bytes + num_bytes > self.limit_bytes:
            raise ClientError("The router is receiving too many request bodies at once; "
                              "retry later", status=503,
                              headers={"Retry-After": "1", **_CLOSE})
        self.held_bytes += num_bytes

    def give(self, num_bytes: int) -> None:
        self.held_bytes -= num_bytes


async def read_body(request: Request, max_bytes: int, timeout_s: float,
                    budget: BodyBudget | None = None) -> bytes:
    """The request body, at most ``max_bytes`` (``ClientError`` 413: a larger
    ``Content-Length`` before anything is read, a chunked body as soon as it passes the
    limit), within ``timeout_s`` of the first read (408); the connection is closed after
    either. With ``budget``, the bytes received are held in it while the body arrives."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ClientError("Invalid Content-Length header", headers=_CLOSE)
        if int(declared) > max_bytes:
            raise ClientError(
                f"Request body too large: the limit is {max_bytes} bytes",
                status=413, headers=_CLOSE,
            )

    held = 0

    async def read() -> bytes:
        nonlocal held
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientError("Client disconnected while sending the body", headers=_CLOSE)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise ClientError(
                    f"Request body too large: the limit is {max_bytes} bytes",
                    status=413, headers=_CLOSE,
                )
            if budget is not None and chunk:
                budget.take(len(chunk))
                held += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    try:
        async with asyncio.timeout(timeout_s):
            return await read()
    except TimeoutError:
        raise ClientError(
            f"Request body not received within {timeout_s:g} s", status=408, headers=_CLOSE
        ) from None
    finally:
        if budget is not None:
            budget.give(held)


def header_list(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_response(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: Mapping[str, str] | None = None,
) -> None:
    """A complete response with ``Content-Length``."""
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw.extend(header_list(headers))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, status: int, message: str, headers: Mapping[str, str] | None = None
) -> None:
    await send_response(send, status, error_json(status, message), headers=headers)


async def start_stream(send: Send, headers: Mapping[str, str]) -> None:
    """Status line and headers of an SSE response; the body follows in chunks."""
    raw = [(b"content-type", SSE), (b"cache-control", b"no-cache"), *header_list(headers)]
    await send({"type": "http.response.start", "status": 200, "headers": raw})


DISCONNECT_SCOPE_KEY = "kvrelay.disconnect"
"""Set in a request's scope by a server that calls ``DisconnectWatch.disconnected`` itself
(``router.server``'s protocol, when the connection is lost mid-request). The server may set
a ``CutOrder`` there instead: the request is cut as soon as its watch is made."""


@dataclass(frozen=True, slots=True)
class CutOrder:
    """Why the server cuts a request (``DisconnectWatch.cut``): the status and message the
    request answers with (an error event on a stream already started)."""

    status: int = 503
    message: str = "the router is shutting down"
    why: str = "at the drain deadline"
    """For the log line, after "stream ... cut"."""
    logged: bool = True
    """Whether a cut stream is logged at INFO (else DEBUG: a client could fill the log)."""


SHUTTING_DOWN = CutOrder()


class DisconnectWatch:
    """Cancels the serving task when its client disconnects (after the body was read), or
    when the server cuts it (``cut``: the drain deadline passed, or the connection is
    abandoned: a request pipelined behind this one went over a head limit).

    Cancelling the task cancels whatever it awaits, e.g. a request to a node, which closes
    that connection and makes vLLM abort the request. ``gone`` / ``was_cut`` tell the task's
    cleanup why it was cancelled (``cut_order``: what to answer). Under kvrelay's own server
    the protocol reports the lost connection (``disconnected``); under any other ASGI server
    a task waits on ``receive()``, which answers ``http.disconnect`` when the connection goes
    away (and once the response is complete, so ``stop()`` must come before the last body
    message).
    """

    __slots__ = ("_task", "_watch", "cut_order", "gone", "was_cut")

    def __init__(self, request: Request) -> None:
        self.gone = False
        self.was_cut = False
        self.cut_order = SHUTTING_DOWN
        self._task = asyncio.current_task()
        self._watch: asyncio.Task[None] | None = None
        ordered = request.scope.get(DISCONNECT_SCOPE_KEY)
        if ordered:
            request.scope[DISCONNECT_SCOPE_KEY] = self
            if isinstance(ordered, CutOrder):  # cut before the watch existed
                self.cut(ordered)
        else:
            self._watch = asyncio.get_running_loop().create_task(self._wait(request.receive))

    def disconnected(self) -> None:
        """The client's connection is gone: stop serving it."""
        if not self.gone and not self.was_cut and self._task is not None:
            self.gone = True
            self._task.cancel()

    async def _wait(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    @property
    def cancelled_us(self) -> bool:
        """Whether a cancellation of the serving task came from this watch."""
        return self.gone or self.was_cut

    def cut(self, order: CutOrder = SHUTTING_DOWN) -> None:
        """Stop the serving task now (it answers what it can, as ``order`` says, and
        returns)."""
        if self._task is not None and not self.gone and not self.was_cut:
            self.was_cut = True
            self.cut_order = order
            self._task.cancel()

    def stop(self) -> None:
        self._task = None
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    async def aclose(self) -> None:
        self._task = None
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


@dataclass(frozen=True)
class Route:
    """``path`` exactly, or with ``prefix`` every path under it (``/v1/responses/``)."""

    path: str
    methods: frozenset[str]
    handler: Handler
    prefix: bool = False


def wants_websocket(scope: Scope) -> bool:
    """Whether an HTTP request asks to become a WebSocket (``Upgrade: websocket``)."""
    return any(
        name.lower() == b"upgrade" and b"websocket" in value.lower()
        for name, value in scope.get("headers", ())
    )


async def refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """The router speaks HTTP only. A WebSocket upgrade that a server passed on as HTTP
    (kvrelay's runs uvicorn with ``ws="none"``) gets 400 and the connection closed; a
    ``websocket`` scope (another server) gets the same 400 through the ASGI denial-response
    extension where the server has it, else a close before the handshake (the server's own
    403)."""
    message = "WebSocket is not supported: the router speaks HTTP/1.1"
    if scope["type"] == "http":
        await send_error(send, 400, message, _CLOSE)
        return
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error_json(400, message)
        await send({"type": "websocket.http.response.start", "status": 400, "headers": [
            (b"content-type", JSON), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


class Routes:
    """Exact-path routes (and prefix ones, tried after them); anything else is a 404, a
    wrong method a 405 (``refusal_json``: the path's API's error body, never a
    redirect). ``HEAD`` is answered wherever ``GET`` is (load balancers and uptime checks
    probe with it): the handler serves a ``GET``, and the server (uvicorn) sends the
    status and headers without the body."""

    def __init__(self, routes: list[Route]) -> None:
        self._routes = {r.path: r for r in routes if not r.prefix}
        self._prefixes = [r for r in routes if r.prefix]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        route = self._routes.get(path)
        if route is None and self._prefixes:
            route = next((r for r in self._prefixes if path.startswith(r.path)), None)
        if route is None:
            await send_response(send, 404, refusal_json(path, 404, "Not found"))
            return
        methods = route.methods
        head = scope["method"] == "HEAD" and "HEAD" not in methods and "GET" in methods
        if scope["method"] not in methods and not head:
            allow = ", ".join(sorted(methods | {"HEAD"} if "GET" in methods else methods))
            await send_response(send, 405, refusal_json(path, 405, "Method not allowed"),
                                headers={"Allow": allow})
            return
        request = Request(scope, receive, send)
        if head:  # served as the GET it asks about; the server sends no body for a HEAD
            request.method = "GET"
        await route.handler(request)
