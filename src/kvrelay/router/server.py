"""Serving the router with uvicorn: two listeners, request-head limits, slow-client deadlines
and graceful shutdown.

**Listeners.** The public address (``host:port``) and the internal one
(``internal_host:internal_port``, loopback by default) where D posts its reports; one server,
one app that dispatches by port (``app.RouterApp``).

**Request heads** are bounded while they are read, before anything else runs (no auth, no
routing): a request line or header line over ``max_header_line_bytes``, a head over
``max_header_bytes`` or more than ``max_headers`` header lines get 431 at once. The router
then stops reading that connection and closes it ``_REJECT_LINGER_S`` later (closing with
unread input would reset the connection and could destroy the 431 before the client reads
it), so a client sending a huge header costs at most that many bytes of buffering.
uvicorn bounds only idle keep-alive connections, so a connection must also deliver a
complete head within ``header_timeout_s`` of opening or of its previous response (else
closed); a body has ``body_timeout_s`` (``asgi.read_body``).

**Graceful shutdown** (``RouterServer``): the first SIGTERM or SIGINT sets the router to
draining: new public requests get 503 with ``Connection: close`` (``/metrics`` still
answers), idle keep-alive connections are closed, and requests in flight, streams included,
may finish for up to ``drain_timeout_s``. Turns still open then are cut: a stream gets an
SSE error event and ``data: [DONE]`` and ends cleanly, one log line each. Both listeners stay
open until then (so a scrape and D's reports for finishing turns still get through, and a
load balancer sees a clear 503 rather than a refused connection); then they close, the app
shuts down and ``kvrelay route`` exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvrelay.router.app import RouterApp
from kvrelay.router.asgi import DISCONNECT_SCOPE_KEY, DisconnectWatch
from kvrelay.router.config import RouterConfig
from kvrelay.router.errors import error_json

log = logging.getLogger("kvrelay.router")

_CUT_GRACE_S = 2.0
_REJECT_LINGER_S = 2.0


class _LingeringTransport:
    """A transport whose ``close()``, while the peer may still be sending (a request whose
    body was not read to its end, a rejected head), stops reading and closes
    ``_REJECT_LINGER_S`` later: closing a socket with unread input resets the connection,
    and the peer may lose the answer it was about to read (a 413 for a body it is still
    sending, a 431). Everything else is the wrapped transport's."""

    __slots__ = ("_loop", "_transport", "_unread", "is_closing", "write")

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
        unread: Callable[[], bool],
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._unread = unread
        self.write = transport.write
        self.is_closing = transport.is_closing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        if not self._unread():
            transport.close()
            return
        with contextlib.suppress(RuntimeError, OSError):
            transport.pause_reading()
        self._loop.call_later(_REJECT_LINGER_S, transport.close)


class _GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol plus head limits and a head deadline (module docstring)."""

    header_timeout_s: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_line_bytes: int = 8 * 1024
    max_headers: int = 100
    _kvrelay_timer: asyncio.TimerHandle | None = None
    _kvrelay_head: bytearray | None = None
    _kvrelay_rejected: bool = False
    _kvrelay_draining: bool = False

    def connection_made(self, transport: Any) -> None:
        lingering = _LingeringTransport(transport, self.loop, self._kvrelay_unread)
        super().connection_made(lingering)  # type: ignore[arg-type]
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._kvrelay_disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            watch = cycle.scope.get(DISCONNECT_SCOPE_KEY)
            if isinstance(watch, DisconnectWatch):
                watch.disconnected()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_SCOPE_KEY] = True  # type: ignore[literal-required]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._kvrelay_draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def shutdown(self) -> None:
        """The drain begins (``RouterServer.shutdown``). uvicorn closes every connection not
        serving a request, which also resets one whose client has just connected or has sent
        part of its next request: that request would be lost rather than answered 503.
        Close only a kept-alive connection with nothing of a next request in; every other
        one is served, and closed after its response (``Connection: close``)."""
        self._kvrelay_draining = True
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self._kvrelay_head:
            self.transport.close()
        elif cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False

    def data_received(self, data: bytes) -> None:
        if self._kvrelay_rejected:
            return
        if self._kvrelay_head is not None and not self._kvrelay_head_ok(data):
            return
        super().data_received(data)

    def _kvrelay_unread(self) -> bool:
        """Whether the client may still be sending: a rejected head, or a body not read to
        its end."""
        cycle = self.cycle
        return self._kvrelay_rejected or (cycle is not None and bool(cycle.more_body))

    def _kvrelay_head_ok(self, data: bytes) -> bool:
        head = self._kvrelay_head
        assert head is not None
        start = max(0, len(head) - 3)
        head += data
        end = head.find(b"\r\n\r\n", start)
        size = end + 4 if end >= 0 else len(head)
        lines = bytes(head[: end if end >= 0 else len(head)]).split(b"\r\n")
        if (
            size > self.max_head_bytes
            or len(lines) - 1 > self.max_headers
            or any(len(line) > self.max_line_bytes for line in lines)
        ):
            self._kvrelay_reject()
            return False
        if end >= 0:
            self._kvrelay_head = None
        return True

    def _kvrelay_reject(self) -> None:
        self._kvrelay_rejected = True
        self._kvrelay_head = None
        self._kvrelay_disarm()
        body = error_json(431, "Request header fields too large")
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
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
        for connection in list(self.server_state.connections):
            connection.shutdown()
        drain_s = self.app.ctx.config.drain_timeout_s
        if not await self._settled(drain_s) and not self.force_exit:
            still = admission.cut_all()
            log.info("drain: %d turn(s) still open after %g s", still, drain_s)
            await self._settled(_CUT_GRACE_S)
        for server in self.servers:
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
    if config.listen_internal_port == 0:
        config = replace(config, internal_port=sockets[1].getsockname()[1])
        log.info("reports on %s", config.report_url)
    server = make_server(config, create_app(config), **uvicorn_options)
    gc.freeze()  # start-up objects never become garbage: keep them out of every collection
    uvloop.run(server.serve(sockets=sockets))
    log.info("router stopped")
