"""Serving the router with uvicorn: two listeners, request-head limits, slow-client deadlines
and graceful shutdown.

**Listeners.** The public address (``host:port``) and the internal one
(``internal_host:internal_port``, loopback by default) where D posts its reports; one server,
one app that dispatches by port (``app.RouterApp``).

**Request heads** are bounded while they are read, before anything else runs (no auth, no
routing): a request line over ``max_header_line_bytes`` gets 414, a header line over it, a
head over ``max_header_bytes`` or more than ``max_headers`` header lines get 431; the
connection is closed at once, so a client sending a huge header costs the router at most
that many bytes of buffering. uvicorn bounds only idle keep-alive connections, so a
connection must also deliver a complete head within ``header_timeout_s`` of opening or of
its previous response (else closed); a body has ``body_timeout_s`` (``asgi.read_body``).

**Graceful shutdown** (``RouterServer``): the first SIGTERM or SIGINT sets the router to
draining (new public requests get 503), closes the public listening socket and idle
keep-alive connections, and lets requests in flight, streams included, finish for up to
``drain_timeout_s``. Turns still open then are cut: a stream gets an SSE error event and
``data: [DONE]`` and ends cleanly, one log line each. The internal listener stays open until
the end, so D's reports for finishing turns still arrive. Then the app shuts down and
``kvrelay route`` exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvrelay.router.app import RouterApp
from kvrelay.router.config import RouterConfig
from kvrelay.router.errors import error_json

log = logging.getLogger("kvrelay.router")

_CUT_GRACE_S = 2.0


class _GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol plus head limits and a head deadline (module docstring)."""

    header_timeout_s: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_line_bytes: int = 8 * 1024
    max_headers: int = 100
    _kvrelay_timer: asyncio.TimerHandle | None = None
    _kvrelay_head: bytearray | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._kvrelay_disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._kvrelay_head is not None and not self._kvrelay_head_ok(data):
            return
        super().data_received(data)

    def _kvrelay_head_ok(self, data: bytes) -> bool:
        head = self._kvrelay_head
        assert head is not None
        start = max(0, len(head) - 3)
        head += data
        end = head.find(b"\r\n\r\n", start)
        size = end + 4 if end >= 0 else len(head)
        lines = bytes(head[: end if end >= 0 else len(head)]).split(b"\r\n")
        status = 0
        if len(lines[0]) > self.max_line_bytes:
            status = 414
        elif (
            size > self.max_head_bytes
            or len(lines) - 1 > self.max_headers
            or any(len(line) > self.max_line_bytes for line in lines[1:])
        ):
            status = 431
        if status:
            self._kvrelay_reject(status)
            return False
        if end >= 0:
            self._kvrelay_head = None
        return True

    def _kvrelay_reject(self, status: int) -> None:
        self._kvrelay_head = None
        self._kvrelay_disarm()
        reason = {414: b"URI Too Long", 431: b"Request Header Fields Too Large"}[status]
        message = {414: "Request line too long", 431: "Request header fields too large"}[status]
        body = error_json(status, message)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body)) + body
        )
        self.transport.close()

    def _kvrelay_arm(self) -> None:
        self._kvrelay_disarm()
        self._kvrelay_timer = self.loop.call_later(self.header_timeout_s, self._kvrelay_expired)

    def _kvrelay_disarm(self) -> None:
        if self._kvrelay_timer is not None:
            self._kvrelay_timer.cancel()
            self._kvrelay_timer = None

    def _kvrelay_expired(self) -> None:
        self._kvrelay_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being served: its body has its own deadline
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(config: RouterConfig) -> type[Any]:
    """uvicorn's ``http`` protocol class with ``config``'s head limits and deadline."""
    return type("KVRelayHttpProtocol", (_GuardedProtocol,), {
        "header_timeout_s": config.header_timeout_s,
        "max_head_bytes": config.max_header_bytes,
        "max_line_bytes": config.max_header_line_bytes,
        "max_headers": config.max_headers,
    })


class RouterServer(uvicorn.Server):
    """A uvicorn server on the router's two listeners that drains on SIGTERM/SIGINT and
    returns normally (module docstring)."""

    def __init__(
        self, config: uvicorn.Config, app: RouterApp, *, install_signals: bool = True
    ) -> None:
        super().__init__(config)
        self.app = app
        self._install_signals = install_signals
        self.public_servers = 1

    def begin_drain(self) -> None:
        """Refuse new work and start the graceful shutdown."""
        admission = self.app.ctx.admission
        if not admission.draining:
            log.info("draining: %d request(s) in flight", admission.in_flight)
        admission.draining = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not uvicorn's: it would re-raise the signal after shutdown (exit status -15)
        if self.app.ctx.admission.draining:
            self.force_exit = True
        else:
            self.begin_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self._install_signals:
            yield
            return
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        admission = self.app.ctx.admission
        admission.draining = True
        for server in self.servers[: self.public_servers]:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        drain_s = self.app.ctx.config.drain_timeout_s
        if not await self._settled(drain_s) and not self.force_exit:
            cut = admission.cut_all()
            log.info("drain deadline (%g s) passed: cutting %d open turn(s)", drain_s, cut)
            await self._settled(_CUT_GRACE_S)
        for server in self.servers[self.public_servers :]:
            server.close()
        for task in list(self.server_state.tasks):
            if not task.done():
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _settled(self, timeout_s: float) -> bool:
        """Wait until no generation request is in flight, at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        admission = self.app.ctx.admission
        while admission.in_flight > 0 and not self.force_exit:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def make_server(
    config: RouterConfig, app: RouterApp, *, install_signals: bool = True, **uvicorn_options: Any
) -> RouterServer:
    """The server for ``app`` (from ``create_app(config)``); serve it with
    ``server.serve(sockets=[bind(public), bind(internal)])`` (``serve`` does)."""
    options: dict[str, Any] = {
        "log_level": config.log_level,
        "access_log": False,
        "timeout_keep_alive": 30,
        "http": protocol_class(config),
        "lifespan": "on",
    }
    options.update(uvicorn_options)
    return RouterServer(uvicorn.Config(app, **options), app, install_signals=install_signals)


def serve(config: RouterConfig, **uvicorn_options: Any) -> None:
    """Run the router until SIGTERM/SIGINT, then drain (blocking)."""
    from kvrelay.router.app import create_app

    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    sockets = [bind(config.host, config.port),
               bind(config.internal_host, config.listen_internal_port)]
    server = make_server(config, create_app(config), **uvicorn_options)
    gc.freeze()  # start-up objects never become garbage: keep them out of every collection
    uvloop.run(server.serve(sockets=sockets))
    log.info("router stopped")
