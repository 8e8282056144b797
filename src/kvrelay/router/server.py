"""Serving the router with uvicorn: two listeners, guarded connections and graceful shutdown.

**Listeners.** The public address (``host:port``) and the internal one
(``internal_host:internal_port``, loopback by default) where D posts its reports; one server,
one app that dispatches by port (``app.RouterApp``).

**Connections** (``router.connection``): every request head, pipelined or not, is bounded
while it is read and due within ``header_timeout_s``; a body has ``body_timeout_s``
(``asgi.read_body``).

**Graceful shutdown** (``RouterServer``): the first SIGTERM or SIGINT sets the router to
draining: new public requests get 503 with ``Connection: close`` (``/metrics`` still
answers), idle keep-alive connections are closed, and requests in flight, streams included,
may finish for up to ``drain_timeout_s``. Turns still open then are cut: a stream gets an
SSE error event and ``data: [DONE]`` and ends cleanly, one log line each. Both listeners stay
open until then (so a scrape and D's reports for finishing turns still get through, and a
load balancer sees a clear 503 rather than a refused connection); then they close, the app
shuts down and ``kvrelay route`` exits 0. A second signal stops at once. With shared state
(``--state``) the router first waits, within the same ``drain_timeout_s``, for D's reports of
the streams that finished (``_reports_in``): their entries outlive it.
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

from kvrelay.router import connection
from kvrelay.router.app import RouterApp
from kvrelay.router.config import RouterConfig

log = logging.getLogger("kvrelay.router")

_CUT_GRACE_S = 2.0


def protocol_class(config: RouterConfig) -> type[Any]:
    """uvicorn's ``http`` protocol class with ``config``'s head limits and deadline."""
    return connection.protocol_class(
        header_timeout_s=config.header_timeout_s,
        max_head_bytes=config.max_header_bytes,
        max_line_bytes=config.max_header_line_bytes,
        max_headers=config.max_headers,
    )


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
        for conn in list(self.server_state.connections):
            conn.shutdown()
        drain_s = self.app.ctx.config.drain_timeout_s
        deadline = asyncio.get_running_loop().time() + drain_s
        if not await self._settled(drain_s) and not self.force_exit:
            still = admission.cut_all()
            log.info("drain: %d turn(s) still open after %g s", still, drain_s)
            await self._settled(_CUT_GRACE_S)
        elif await self.app.ctx.index.shared_state() is not None:
            await self._reports_in(deadline)
        for server in self.servers:
            server.close()
        for task in list(self.server_state.tasks):
            if not task.done():
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _reports_in(self, deadline: float) -> None:
        """Wait until no finished turn awaits D's report (its own timeout settles it), at
        most until ``deadline``: with shared state the entry outlives this replica, and a
        stream that ended in the drain commits when D's report comes, ~0.1 s later. The
        router exited first and the conversation's next turn, on another replica,
        recomputed (probe 14, K8: on every rolling update)."""
        desk = self.app.ctx.desk
        if len(desk):
            log.info("drain: waiting for D's report of %d finished turn(s)", len(desk))
        await self._until_none(lambda: len(desk), deadline)

    async def _settled(self, timeout_s: float) -> bool:
        """Wait until no generation request is in flight, at most ``timeout_s``."""
        admission = self.app.ctx.admission
        deadline = asyncio.get_running_loop().time() + timeout_s
        return await self._until_none(lambda: admission.in_flight, deadline)

    async def _until_none(self, count: Callable[[], int], deadline: float) -> bool:
        """Wait until ``count()`` is 0 (True), the loop's clock reaches ``deadline`` or a
        second signal forces the exit (False unless the count is 0 then)."""
        loop = asyncio.get_running_loop()
        while count() > 0 and not self.force_exit:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return count() == 0 or self.force_exit


class ListenError(RuntimeError):
    """The router cannot listen where it was told (port in use, no such address)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ``ListenError`` saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {host}:{port}: {why}") from None
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
        "ws": "none",  # HTTP only: an upgrade reaches the app, which refuses it (400)
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
